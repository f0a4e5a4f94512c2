"""evals.heldout_decode on the tiny target: a sample played back decodes as the live target
does, a draft proposing the sample's own continuation reaches k + 1 through it, the trainer's
side is the train stage's measure, and a workspace without the stages' outputs is one line."""

import pytest
import torch

from dspark.data.shards import TokenSample
from dspark.decode.decoder import SpecDecoder
from dspark.decode.drafters import DSparkProposer
from dspark.extract.capture import HiddenStateCapture
from evals.heldout_decode import decode_tallies, main, prompt_length, trainer_measure
from tests.unit.test_alignment import TargetAsDraft
from tests.unit.test_decode_as_trained import Recorded
from tests.unit.test_spec_decode import Oracle, tiny_drafts

TAPS = [0, 1]
NEW = 20


@pytest.fixture(scope="module")
def samples(varied):
    """Three prompts and the target's greedy answers, captured as on-policy extraction does."""
    gen = torch.Generator().manual_seed(2)
    out = []
    for i, n in enumerate((6, 11, 9)):
        prompt = torch.randint(10, varied.vocab_size, (1, n), generator=gen)
        ids = varied.model.generate(
            input_ids=prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=NEW,
            min_new_tokens=NEW,
            do_sample=False,
            pad_token_id=0,
        )[0]
        mask = torch.arange(ids.shape[0]) >= n
        out.append(TokenSample(i, f"p{i}", ids.to(torch.int32), mask))
    capture = HiddenStateCapture(varied, TAPS, "float32", 16)
    captured = [capture(s) for s in out]
    capture.close()
    return captured


def test_a_played_back_sample_decodes_as_the_live_target(samples, llama, varied):
    (model, ids), _ = tiny_drafts(varied)
    for x in samples:
        replayed, live = Recorded(DSparkProposer(model, ids)), Recorded(DSparkProposer(model, ids))
        tally = decode_tallies(replayed, [x], TAPS, varied.vocab_size, varied.eos_token_id)
        p = prompt_length(x)
        room = x.num_tokens - p - replayed.k - 2
        traces, _ = SpecDecoder(llama, live, varied.eos_token_id, 2048).generate(
            [x.input_ids[:p].tolist()], room
        )
        # The draft saw the same features at the same anchors: it proposed the same tokens.
        steps = [
            [(n.tolist(), own.tokens.tolist()) for n, _, own in r.steps] for r in (replayed, live)
        ]
        assert steps[0] == steps[1] and len(steps[0]) > 3
        assert tally[x.sample_id].steps == traces[0].steps
        assert tally[x.sample_id].emitted == sum(traces[0].emitted)


def test_the_samples_own_continuation_reaches_k_plus_one(samples, varied):
    prompts = [x.input_ids[: prompt_length(x)].tolist() for x in samples]
    answers = [x.input_ids[prompt_length(x) :].tolist() for x in samples]
    oracle = Oracle(prompts, answers)  # drafts row i's continuation: one sample a decode
    for i, x in enumerate(samples):
        oracle.full = [prompts[i] + answers[i] + [0] * 8]
        tally = decode_tallies(oracle, [x], TAPS, varied.vocab_size, varied.eos_token_id)[i]
        # every step but the last emits k + 1 tokens: all k drafts and the target's own
        assert tally.steps > 1 and tally.accepted == [tally.steps] * oracle.k
        assert tally.emitted >= (tally.steps - 1) * (oracle.k + 1)


def test_the_trainer_side_is_the_train_stages_measure(samples, varied):
    every = torch.arange(varied.vocab_size)
    good = trainer_measure(TargetAsDraft(varied), every, samples, varied, batch_size=2)
    assert good["greedy_path"] == 1.0  # the samples are the target's greedy answers
    assert good["tau_greedy"] == pytest.approx(TargetAsDraft(varied).cfg.block_size + 1)
    # walked as decoding steps: k + 1 a step but where the answer's end cuts a run short
    assert 4.0 < good["tau_decode"] <= TargetAsDraft(varied).cfg.block_size + 1
    off = trainer_measure(TargetAsDraft(varied, shift=1), every, samples, varied, batch_size=2)
    assert off["tau_greedy"] < 1.5 and off["tau_decode"] < 1.5


def test_a_workspace_without_outputs_is_one_line(tmp_path, capsys):
    (tmp_path / "params.yaml").write_text("profile: default\n")
    assert main(["--root", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err
