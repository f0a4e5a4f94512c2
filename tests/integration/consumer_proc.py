"""A consumer in its own process (for the restart test): receives and records sample ids.

python -m tests.integration.consumer_proc MASTER PORT IDS_FILE NUM
"""

import sys

from dspark.transport.control import Coordinator
from dspark.transport.stores import MooncakeStore
from dspark.transport.stream import StreamConsumer


def main() -> None:
    master, port, ids_file, num = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    coordinator = Coordinator(list(range(num)), port=port, max_in_flight=4)
    store = MooncakeStore(master, segment_bytes=0, buffer_bytes=16 << 20)
    with open(ids_file, "a") as out:
        for sample in StreamConsumer(coordinator, store):
            out.write(f"{sample.sample_id}\n")
            out.flush()


if __name__ == "__main__":
    main()
