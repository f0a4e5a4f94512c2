"""Where payloads wait between producer and consumer, behind one small interface.

    mooncake  hs-connectors' MooncakeHiddenStatesStore over a local or remote mooncake_master:
              the payload stays in the producer's registered memory until deleted
    files     one safetensors file per sample in a shared folder (tests, shared filesystems)

The manifest always travels on the control channel; a store moves payload bytes only.
"""

from __future__ import annotations

import re
import threading
import time
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from dspark.io import atomic_path

OBJECT_NOT_FOUND = -704  # Mooncake's status for a missing key


class TransportError(RuntimeError):
    """A payload could not be stored or fetched (peer gone, timeout, store failure)."""


class PayloadStore(ABC):
    @abstractmethod
    def put(self, manifest: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None: ...

    @abstractmethod
    def get(self, manifest: dict[str, Any], timeout: float) -> dict[str, torch.Tensor]: ...

    @abstractmethod
    def delete(self, handle: str) -> None: ...

    def get_many(
        self, manifests: list[dict[str, Any]], timeout: float
    ) -> list[dict[str, torch.Tensor] | TransportError]:
        """Several payloads; a failed one comes back as its error, in its place."""
        out: list[dict[str, torch.Tensor] | TransportError] = []
        for m in manifests:
            try:
                out.append(self.get(m, timeout))
            except TransportError as e:
                out.append(e)
        return out

    def close(self) -> None:  # noqa: B027 - optional
        pass


class MooncakeStore(PayloadStore):
    """Mooncake through hs-connectors' object format; `setup` is lazy (safe across processes).

    Producers write the packed object themselves, pinned to their own segment
    (`preferred_segment`): a producer's payloads then live and die with it, which is what
    re-assignment assumes. With the default placement a put can land in another producer's
    segment, and a put into a dead producer's segment blocks. Consumers read batches with one
    `batch_get_into`; `get` (one sample) is hs-connectors' own `get_sample`.
    """

    def __init__(
        self, master: str, *, host: str = "127.0.0.1", segment_bytes: int, buffer_bytes: int
    ):
        self.master, self.host = master, host
        self.segment_bytes, self.buffer_bytes = segment_bytes, buffer_bytes
        self._reader = None  # hs-connectors store (consumer side, single gets)
        self._batch_reader = None  # raw store (consumer side, batched gets)
        self._get_staging: torch.Tensor | None = None
        self._lock = threading.Lock()
        self._writer = None  # raw MooncakeDistributedStore (producer side)
        self._staging: torch.Tensor | None = None

    def _join(self, what: str, fn):
        try:
            return fn()
        except Exception as e:  # Mooncake reports failures as RuntimeError with a status
            raise TransportError(f"mooncake: {what} via master {self.master}: {e}") from e

    def _require_reader(self):
        if self._reader is None:
            from hs_connectors.mooncake_store import MooncakeHiddenStatesStore, MooncakeStoreConfig

            config = MooncakeStoreConfig(
                local_hostname=self.host,
                metadata_server="P2PHANDSHAKE",
                master_server_address=self.master,
                global_segment_size=self.segment_bytes,
                local_buffer_size=self.buffer_bytes,
                protocol="tcp",
                num_writer_threads=1,
            )
            self._reader = self._join("setup", MooncakeHiddenStatesStore(config).setup)
        return self._reader

    def _raw_store(self, segment_bytes: int):
        from mooncake.store import MooncakeDistributedStore

        store = MooncakeDistributedStore()
        args = (self.host, "P2PHANDSHAKE", segment_bytes, self.buffer_bytes, "tcp", "", self.master)
        rc = self._join("setup", lambda: store.setup(*args))
        if rc != 0:
            raise TransportError(f"mooncake: setup via master {self.master} failed ({rc})")
        return store

    def _require_writer(self):
        if self._writer is None:
            self._writer = self._raw_store(self.segment_bytes)
        return self._writer

    def _staging_for(self, nbytes: int) -> torch.Tensor:
        store = self._require_writer()
        if self._staging is None or self._staging.numel() < nbytes:
            if self._staging is not None:
                store.unregister_buffer(self._staging.data_ptr())
            self._staging = torch.empty(max(nbytes, 1 << 20) * 2, dtype=torch.uint8)
            self._staging.fill_(0)  # prefault: first writes into fresh pages are slow
            rc = store.register_buffer(self._staging.data_ptr(), self._staging.numel())
            if rc != 0:
                raise TransportError(f"mooncake: register_buffer failed ({rc})")
        return self._staging

    def put(self, manifest, tensors):
        from mooncake.store import ReplicateConfig

        total = manifest["metadata"]["total_aligned_bytes"]
        staging = self._staging_for(total)
        for name, spec in manifest["tensors"].items():
            t = tensors[name]
            region = staging[spec["offset"] : spec["offset"] + spec["nbytes"]]
            region.view(t.dtype).view(t.shape).copy_(t)
        config = ReplicateConfig()
        config.preferred_segment = self._writer.get_hostname()
        rc = self._writer.put_from(manifest["handle"], staging.data_ptr(), total, config)
        if rc != 0:
            raise TransportError(f"mooncake put {manifest['handle']}: status {rc}")

    def get(self, manifest, timeout):
        try:
            return self._require_reader().get_sample(manifest, timeout=timeout)
        except TransportError:
            raise
        except Exception as e:
            raise TransportError(f"mooncake get {manifest['handle']}: {e}") from e

    def _require_batch_reader(self):
        if self._batch_reader is None:
            self._batch_reader = self._raw_store(0)  # a reader contributes no memory
        return self._batch_reader

    def get_many(self, manifests, timeout):
        """One `batch_get_into` for all: per-object overhead dominates ~1 MB samples. The bytes
        are hs-connectors' packed objects, unpacked by the manifests' tensor specs. Consumers
        sharing this store (ranks as threads, in tests) take turns on its one staging buffer."""
        with self._lock:
            return self._get_many(manifests, timeout)

    def _get_many(self, manifests, timeout):
        store = self._require_batch_reader()
        sizes = [m["metadata"]["total_aligned_bytes"] for m in manifests]
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        total = sum(sizes)
        if self._get_staging is None or self._get_staging.numel() < total:
            if self._get_staging is not None:
                store.unregister_buffer(self._get_staging.data_ptr())
            self._get_staging = torch.zeros(max(total, 1 << 20) * 2, dtype=torch.uint8)
            rc = store.register_buffer(self._get_staging.data_ptr(), self._get_staging.numel())
            if rc != 0:
                raise TransportError(f"mooncake: register_buffer failed ({rc})")
        base = self._get_staging.data_ptr()
        results: list = [None] * len(manifests)
        pending = list(range(len(manifests)))
        deadline = time.monotonic() + timeout
        while pending:
            codes = store.batch_get_into(
                [manifests[i]["handle"] for i in pending],
                [base + starts[i] for i in pending],
                [sizes[i] for i in pending],
            )
            missing = []
            for i, code in zip(pending, codes, strict=True):
                if code == sizes[i]:
                    results[i] = _unpack(manifests[i], self._get_staging, starts[i])
                elif code == OBJECT_NOT_FOUND and time.monotonic() < deadline:
                    missing.append(i)  # announced before stored (vLLM's connector does this)
                else:
                    results[i] = TransportError(
                        f"mooncake get {manifests[i]['handle']}: status {code}"
                    )
            pending = missing
            if pending:
                time.sleep(0.02)
        return results

    def delete(self, handle):
        rc = self._require_writer().remove(handle, force=True)
        if rc not in (0, OBJECT_NOT_FOUND):
            raise TransportError(f"mooncake delete {handle}: status {rc}")

    def close(self) -> None:
        for store in (self._writer, self._batch_reader):
            if store is not None:
                store.close()
        self._writer = self._batch_reader = None


def _unpack(manifest: dict[str, Any], buf: torch.Tensor, start: int) -> dict[str, torch.Tensor]:
    out = {}
    for name, spec in manifest["tensors"].items():
        dtype = getattr(torch, str(spec["dtype"]).removeprefix("torch."))
        a = start + int(spec["offset"])
        out[name] = buf[a : a + int(spec["nbytes"])].view(dtype).view(spec["shape"]).clone()
    return out


class FileStore(PayloadStore):
    """One safetensors file per sample: `<folder>/<handle>.safetensors`."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)

    def _path(self, handle: str) -> Path:
        return self.folder / (re.sub(r"[^A-Za-z0-9_.-]", "_", handle) + ".safetensors")

    def put(self, manifest, tensors):
        with atomic_path(self._path(manifest["handle"])) as tmp:
            save_file({k: t.contiguous() for k, t in tensors.items()}, str(tmp))

    def get(self, manifest, timeout):
        path = self._path(manifest["handle"])
        try:
            return load_file(str(path))
        except FileNotFoundError:
            raise TransportError(f"files: {path} is missing") from None
        except Exception as e:
            raise TransportError(f"files: {path} unreadable ({e})") from e

    def delete(self, handle):
        self._path(handle).unlink(missing_ok=True)
