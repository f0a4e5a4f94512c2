"""What our importer assumes for a key a speculators config.json omits is what speculators 0.9.0
itself assumes: read from its DSparkSpeculatorConfig in its own venv."""

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
from speculators.models.dspark import DSparkSpeculatorConfig
fields = DSparkSpeculatorConfig.model_fields
print(json.dumps({
    "version": version("speculators"),
    "defaults": {k: fields[k].get_default(call_default_factory=True) for k in sys.argv[1:]},
}))
"""


def test_our_import_defaults_are_speculators_own(spec_python):  # noqa: F811
    out = subprocess.run(
        [str(SPEC_PY), "-c", DUMP, *SPECULATORS_DEFAULTS],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["version"] == SPECULATORS_VERSION
    assert got["defaults"] == SPECULATORS_DEFAULTS
