"""What our importer assumes for a key a speculators config.json omits is what speculators 0.9.0
itself assumes: read from its DSparkSpeculatorConfig and DFlashSpeculatorConfig in its own venv."""

import json
import os
import subprocess

import pytest

from dspark.export import SPECULATORS_DEFAULTS, SPECULATORS_VERSION

from .test_parity import SPEC_PY, spec_python  # noqa: F401  (a fixture)

pytestmark = pytest.mark.slow

DUMP = """
import json, sys
from importlib.metadata import version
from speculators.models.dflash import DFlashSpeculatorConfig
from speculators.models.dspark import DSparkSpeculatorConfig
classes = {"dspark": DSparkSpeculatorConfig, "dflash": DFlashSpeculatorConfig}
wanted = json.loads(sys.argv[1])
print(json.dumps({
    "version": version("speculators"),
    "defaults": {
        kind: {
            k: classes[kind].model_fields[k].get_default(call_default_factory=True) for k in keys
        }
        for kind, keys in wanted.items()
    },
}))
"""


def test_our_import_defaults_are_speculators_own(spec_python):  # noqa: F811
    out = subprocess.run(
        [
            str(SPEC_PY),
            "-c",
            DUMP,
            json.dumps({k: list(v) for k, v in SPECULATORS_DEFAULTS.items()}),
        ],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["version"] == SPECULATORS_VERSION
    assert got["defaults"] == SPECULATORS_DEFAULTS
