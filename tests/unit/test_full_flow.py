"""The main flow's edit of params.yaml: validated whole before it writes."""

import pytest

from dspark.errors import ConfigError
from flows.full import set_profile

from ..conftest import ROOT


def test_set_profile_refuses_a_file_lacking_a_watched_section_and_writes_nothing(tmp_path):
    path = tmp_path / "params.yaml"
    text = (ROOT / "params.yaml").read_text().replace("    provision: {}\n", "", 1)
    path.write_text(text)
    with pytest.raises(ConfigError, match=r"profiles\.smoke\.provision missing"):
        set_profile(path, "full")
    assert path.read_text() == text


def test_set_profile_touches_only_the_profile_line(tmp_path):
    path = tmp_path / "params.yaml"
    text = (ROOT / "params.yaml").read_text()
    path.write_text(text)
    set_profile(path, "full")
    assert path.read_text() == text.replace("profile: default", "profile: full", 1)
