"""Training on the tiny target: learning, resume, checkpoints and the export round trip."""

import csv
import logging
import signal
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from dspark.data.shards import TokenSample
from dspark.drafts import load_draft
from dspark.errors import DataError, ResourceError
from dspark.export import export_speculators, import_speculators, roundtrip_diff
from dspark.extract.capture import HiddenStateCapture
from dspark.models.dspark import DSparkConfig, DSparkDraft
from dspark.models.layers import RMSNorm
from dspark.models.vocab import build_draft_ids, count_tokens
from dspark.schema import Sample
from dspark.stopping import Stopped, StopRequest
from dspark.train.batch import TargetHead, collate
from dspark.train.checkpoint import read_state, save_draft
from dspark.train.losses import LossWeights
from dspark.train.objectives import DSparkObjective
from dspark.train.sources import Source
from dspark.train.stage import build_runs, summarize, write_curves
from dspark.train.trainer import DraftRun, Trainer
from flows.sweep import DEFAULT_METRIC, _dig

from ..unit.test_drafts import SHAPE


@pytest.fixture(scope="module")
def samples(tiny_target) -> list[Sample]:
    """Real hidden states of the tiny target on random token sequences."""
    gen = torch.Generator().manual_seed(0)
    cap = HiddenStateCapture(tiny_target, [0, 1], "float32")
    out = []
    for i in range(10):
        s = 24 + 3 * i
        ids = torch.randint(10, 2000, (s,), generator=gen, dtype=torch.int32)
        mask = torch.zeros(s, dtype=torch.bool)
        mask[8:] = True
        out.append(cap(TokenSample(i, f"p{i}", ids, mask)))
    cap.close()
    return out


def tiny_params(smoke_params, dspark: dict | None = None, **train):
    from dspark.config import Params

    tree = smoke_params.model_dump()
    tree["train"].update(
        draft_vocab_size=256, batch_size=2, epochs=2, eval_samples=2, checkpoint_every=3, **train
    )
    tree["train"]["dspark"].update(block_size=4, markov_rank=16, **(dspark or {}))
    return Params.model_validate(tree)


def make_trainer(params, tiny_target, samples, folder, **kw) -> Trainer:
    counts = count_tokens(samples, tiny_target.vocab_size)
    draft_ids = build_draft_ids(counts, params.train.draft_vocab_size)
    runs = build_runs(params, tiny_target, draft_ids, [0, 1], mask_id=3)
    return Trainer(
        cfg=params.train,
        runs=runs,
        head=TargetHead(tiny_target.norm, tiny_target.lm_head, draft_ids),
        checkpoint_dir=folder,
        fingerprint="test",
        progress=False,
        **kw,
    )


def memory_source(samples, fail_after: int | None = None):
    by_id = {s.sample_id: s for s in samples}
    calls = {"n": 0}  # across epochs

    @contextmanager
    def open_source(ids):

        def stream():
            for i in sorted(ids):
                yield by_id[i]

        src = Source(stream())
        take = src.take

        def limited(wanted):
            calls["n"] += 1
            if fail_after is not None and calls["n"] > fail_after:
                raise KeyboardInterrupt("simulated interruption")
            return take(wanted)

        src.take = limited
        yield src

    return open_source


@pytest.mark.parametrize("context_scale", [False, True])
def test_resume_continues_bit_exact(smoke_params, tiny_target, samples, tmp_path, context_scale):
    # The context scale is measured at step 0, then checkpointed with the weights.
    params = tiny_params(smoke_params, dspark={"context_scale": context_scale})
    ids = [s.sample_id for s in samples]
    train_ids, eval_ids = ids[2:], ids[:2]

    whole = make_trainer(params, tiny_target, samples, tmp_path / "a")
    whole.fit(memory_source(samples), train_ids, eval_ids)

    broken = make_trainer(params, tiny_target, samples, tmp_path / "b")
    with pytest.raises(KeyboardInterrupt):  # dies after step 4; the checkpoint is at step 3
        broken.fit(memory_source(samples, fail_after=1 + 4), train_ids, eval_ids)
    resumed = make_trainer(params, tiny_target, samples, tmp_path / "b")
    resumed.fit(memory_source(samples), train_ids, eval_ids)

    assert resumed.resumed_from == 3 and resumed.step == whole.step == 8
    for a, b in zip(whole.runs, resumed.runs, strict=True):
        sa, sb = a.model.state_dict(), b.model.state_dict()
        assert all(torch.equal(sa[k], sb[k]) for k in sa), f"{a.name} weights differ"
        assert [p[1:] for p in a.curve] == [p[1:] for p in b.curve]  # tokens and tau_sim


def test_a_stop_request_checkpoints_at_that_step_and_resumes_bit_exact(
    smoke_params, tiny_target, samples, tmp_path
):
    """Stopped between checkpoints (step 4; they fall every 3): nothing is lost."""
    params = tiny_params(smoke_params)
    ids = [s.sample_id for s in samples]
    train_ids, eval_ids = ids[2:], ids[:2]
    whole = make_trainer(params, tiny_target, samples, tmp_path / "a")
    whole.fit(memory_source(samples), train_ids, eval_ids)

    stopped = make_trainer(params, tiny_target, samples, tmp_path / "b", stop=StopRequest())
    source = memory_source(samples)

    @contextmanager
    def asks_after_step_4(need):
        with source(need) as src:
            take = src.take

            def take_then_ask(wanted):
                if stopped.step == 3 and wanted != eval_ids:
                    stopped.stop.set(signal.SIGINT)  # as if Ctrl-C came during step 4
                return take(wanted)

            src.take = take_then_ask
            yield src

    with pytest.raises(Stopped, match=r"^train: stopped at step 4 of 8; the checkpoint in ") as e:
        stopped.fit(asks_after_step_4, train_ids, eval_ids)
    assert e.value.code == 130
    assert read_state(tmp_path / "b")["step"] == 4
    resumed = make_trainer(params, tiny_target, samples, tmp_path / "b")
    resumed.fit(memory_source(samples), train_ids, eval_ids)
    assert resumed.resumed_from == 4 and resumed.step == 8
    for a, b in zip(whole.runs, resumed.runs, strict=True):
        sa, sb = a.model.state_dict(), b.model.state_dict()
        assert all(torch.equal(sa[k], sb[k]) for k in sa), f"{a.name} weights differ"
        assert [p[1:] for p in a.curve] == [p[1:] for p in b.curve]


def test_a_checkpoint_of_another_configuration_is_not_resumed(
    smoke_params, tiny_target, samples, tmp_path
):
    params = tiny_params(smoke_params)
    first = make_trainer(params, tiny_target, samples, tmp_path)
    first.fit(memory_source(samples), [2, 3, 4, 5], [0, 1])
    other = make_trainer(params, tiny_target, samples, tmp_path)
    other.fingerprint = "something else"
    assert other._resume() == (0, 0) and other.step == 0


def test_a_tiny_draft_overfits_to_nearly_the_block_size():
    """A deterministic next-token rule, a peaked target: tau_sim approaches block_size + 1."""
    torch.manual_seed(0)
    vocab, k = 48, 4
    embed = nn.Embedding(vocab, SHAPE.hidden_size)
    lm_head = nn.Linear(SHAPE.hidden_size, vocab, bias=False)
    with torch.no_grad():
        lm_head.weight.copy_(8 * nn.functional.normalize(embed.weight, dim=-1))
    head = TargetHead(RMSNorm(SHAPE.hidden_size, 1e-6), lm_head, torch.arange(vocab))
    cfg = DSparkConfig(
        layer=SHAPE,
        num_layers=1,
        block_size=k,
        aux_layers=(0,),
        vocab_size=vocab,
        draft_vocab_size=vocab,
        mask_token_id=vocab - 1,
        markov_rank=16,
    )
    model = DSparkDraft(cfg, embed, lm_head.weight.detach())
    batch_samples = []
    for i in range(2):
        ids = (torch.arange(40) * 5 + 7 * i) % (vocab - 1)  # x_{t+1} = x_t + 5 (mod 47)
        nxt = torch.cat((ids[1:], ids[:1]))
        mask = torch.zeros(40, dtype=torch.bool)
        mask[4:] = True
        batch_samples.append(
            Sample(
                i,
                ids.to(torch.int32),
                mask,
                embed.weight[ids].detach()[None],
                nn.functional.normalize(embed.weight[nxt], dim=-1).detach() * 6,
            )
        )
    batch = collate(batch_samples, head)
    from dspark.config import OptimConfig

    run = DraftRun(
        "dspark",
        model,
        DSparkObjective(LossWeights(confidence=1.0), 64),
        DSparkObjective(LossWeights(confidence=1.0), None),
        OptimConfig(lr=3e-3, warmup_fraction=0.0, schedule="constant"),
        slots=k,
    )
    for step in range(150):
        run.step(batch, step, 150, 0, 0.0)
    tau = run.evaluate([batch])["tau_sim"]
    assert tau > 0.9 * (k + 1), tau


def test_draft_checkpoint_round_trips_and_rejects_mismatches(
    smoke_params, tiny_target, samples, tmp_path
):
    params = tiny_params(smoke_params)
    counts = count_tokens(samples, tiny_target.vocab_size)
    draft_ids = build_draft_ids(counts, 256)
    run = build_runs(params, tiny_target, draft_ids, [0, 1], mask_id=3)[0]
    folder = tmp_path / "dspark"
    folder.mkdir()
    save_draft(folder, run.model, draft_ids, {})
    back, back_ids = load_draft(folder, tiny_target.embed)
    assert torch.equal(back_ids, draft_ids)
    assert roundtrip_diff(run.model, back) == 0.0

    with pytest.raises(DataError, match="vocabulary"):
        load_draft(folder, nn.Embedding(1000, 64))
    with pytest.raises(DataError, match="hidden size"):
        load_draft(folder, nn.Embedding(tiny_target.vocab_size, 32))
    tensors = load_file(folder / "model.safetensors")
    tensors["fc.weight"] = tensors["fc.weight"][:, :10].contiguous()
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(DataError, match=r"fc\.weight: shape"):
        load_draft(folder, tiny_target.embed)
    (folder / "model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(DataError, match="not a readable safetensors file"):
        load_draft(folder, tiny_target.embed)


def exported_back(model, draft_ids, target, folder):
    """Random weights (so a lost tensor shows), exported in speculators' format and imported
    back -> (config.json's doc, the imported draft, its draft ids)."""
    for p in model.parameters():
        nn.init.normal_(p, std=0.1)
    doc = export_speculators(
        model,
        draft_ids,
        folder,
        verifier_config=target.model.config.to_dict(),
        verifier_path="tiny",
    )
    back, back_ids = import_speculators(folder, target.embed, target.lm_head)
    return doc, back, back_ids


@pytest.mark.parametrize("variant,rank", [("vanilla", 16), ("rnn", 16), ("vanilla", 0)])
def test_speculators_export_imports_back_exactly(
    smoke_params, tiny_target, samples, tmp_path, variant, rank
):
    params = tiny_params(smoke_params)
    tree = params.model_dump()
    tree["train"]["dspark"].update(
        markov_head=variant, markov_rank=rank, confidence_with_markov=rank > 0
    )
    from dspark.config import Params

    params = Params.model_validate(tree)
    draft_ids = build_draft_ids(count_tokens(samples, tiny_target.vocab_size), 256)
    model = build_runs(params, tiny_target, draft_ids, [0, 1], mask_id=3)[0].model
    doc, back, back_ids = exported_back(model, draft_ids, tiny_target, tmp_path / "export")
    assert doc["speculators_model_type"] == "dspark"
    assert doc["aux_hidden_state_layer_ids"] == [1, 2]  # HF hidden_states indexing
    assert doc["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 4
    tensors = load_file(tmp_path / "export" / "model.safetensors")
    assert torch.equal(torch.arange(256) + tensors["d2t"], draft_ids)
    assert int(tensors["t2d"].sum()) == 256 and "embed_tokens.weight" not in tensors
    assert torch.equal(back_ids, draft_ids)
    assert roundtrip_diff(model, back) == 0.0


def test_a_non_finite_loss_stops_training_with_a_clear_error(smoke_params, tiny_target, samples):
    params = tiny_params(smoke_params)
    draft_ids = build_draft_ids(count_tokens(samples, tiny_target.vocab_size), 256)
    run = build_runs(params, tiny_target, draft_ids, [0, 1], mask_id=3)[0]
    batch = collate(samples[:2], TargetHead(tiny_target.norm, tiny_target.lm_head, draft_ids))
    batch.aux[:] = float("nan")
    with pytest.raises(DataError, match="non-finite loss at step 0"):
        run.step(batch, 0, 10, 0, 0.0)


def test_target_head_runs_on_a_bfloat16_target():
    torch.manual_seed(0)
    lm_head = nn.Linear(16, 40, bias=False).to(torch.bfloat16)
    head = TargetHead(RMSNorm(16, 1e-6).to(torch.bfloat16), lm_head, torch.arange(0, 40, 2))
    p = head.probs(torch.randn(5, 16))
    assert p.dtype == torch.float32 and p.shape == (5, 20) and bool((p.sum(-1) <= 1.0001).all())


def test_the_markov_ablation_trains_every_variant_beside_the_main_drafts(
    smoke_params, tiny_target, samples
):
    from dspark.train.stage import summarize

    params = tiny_params(smoke_params, markov_ablation=True)
    draft_ids = build_draft_ids(count_tokens(samples, tiny_target.vocab_size), 256)
    runs = build_runs(params, tiny_target, draft_ids, [0, 1], mask_id=3)
    assert [r.name for r in runs] == [
        "dspark",
        "dspark_gated",
        "dspark_rnn",
        "dspark_rank0",
        "dflash",
        "eagle3",
    ]
    cfgs = {r.name: r.model.cfg for r in runs}
    assert cfgs["dspark_gated"].markov_head == "gated" and cfgs["dspark_rnn"].markov_head == "rnn"
    assert (
        cfgs["dspark_rank0"].markov_rank == 0
        and cfgs["dspark_rank0"].confidence_with_markov is False
    )
    assert runs[3].model.markov_head is None
    for i, run in enumerate(runs):
        run.wall_s, run.curve = 10.0 + i, [[0.0, 0, 1.0], [10.0 + i, 100, 1.5 + i / 10]]
        run.last_eval = {"tau_sim": 1.5 + i / 10, "pos_accept": [0.1] * 4, "loss": 1.0}
    out = summarize(runs, tokens=100)
    assert set(out["markov_ablation"]) == {"vanilla", "gated", "rnn", "rank0"}
    assert out["markov_ablation"]["rank0"]["tau_sim"] == 1.8  # runs[3], dflash is runs[4]
    assert out["goal"]["eagle3_final_tau_sim"] == 2.0 and out["goal"]["met"] is False


def test_curves_of_a_checkpoint_from_before_greedy_tau_still_write(tmp_path):
    """A run resumed from an older checkpoint holds 3-field points (no tau_greedy) before its
    4-field ones: the CSV leaves their greedy cell empty and the plot skips them."""
    run = SimpleNamespace(name="dspark", curve=[[0.0, 0, 1.0], [5.0, 50, 1.2, 1.3]])
    write_curves([run], tmp_path / "c.csv", tmp_path / "c.png")
    rows = list(csv.DictReader((tmp_path / "c.csv").open()))
    assert [(r["tau_sim"], r["tau_greedy"]) for r in rows] == [("1.0", ""), ("1.2", "1.3")]
    assert (tmp_path / "c.png").stat().st_size > 0


def test_every_draft_tensor_lands_on_the_training_device(tiny_target_dir, smoke_params):
    """What `train.device` moves: each draft's weights, buffers and the target embedding it
    borrows outside its module tree. The meta device stands in for a GPU here."""
    from dspark.models.target import load_target

    target = load_target(tiny_target_dir)  # its modules move: not the shared fixture
    params = tiny_params(smoke_params, markov_ablation=True)
    draft_ids = torch.arange(256)
    meta = torch.device("meta")
    runs = build_runs(params, target, draft_ids, [0, 1], mask_id=3, device=meta)
    assert {r.name for r in runs} == {
        "dspark",
        "dspark_gated",
        "dspark_rnn",
        "dspark_rank0",
        "dflash",
        "eagle3",
    }
    for run in runs:
        tensors = [*run.model.parameters(), *run.model.buffers(), run.model.embed.weight]
        assert {t.device for t in tensors} == {meta}, run.name
        assert all(p.device == meta for p in run.optimizer.param_groups[0]["params"]), run.name


def test_dflash_is_dsparks_backbone_without_heads_trained_on_ce_alone(
    smoke_params, tiny_target, samples
):
    params = tiny_params(smoke_params)
    draft_ids = build_draft_ids(count_tokens(samples, tiny_target.vocab_size), 256)
    runs = {r.name: r for r in build_runs(params, tiny_target, draft_ids, [0, 1], mask_id=3)}
    dspark, dflash = runs["dspark"], runs["dflash"]
    assert dflash.model.cfg.kind == "dflash"
    assert dflash.model.markov_head is None and dflash.model.confidence_head is None
    for field in ("block_size", "mask_token_id", "aux_layers", "draft_vocab_size"):
        assert getattr(dflash.model.cfg, field) == getattr(dspark.model.cfg, field), field
    w = dflash.objective.weights
    assert (w.ce, w.tv, w.kl, w.confidence, w.gamma) == (1.0, 0.0, 0.0, 0.0, 4.0)
    assert dflash.objective.max_anchors == params.train.dspark.max_anchors  # unless set apart
    assert dflash.model.cfg.num_layers == dspark.model.cfg.num_layers
    shared = {k for k in dspark.model.state_dict() if not k.startswith(("markov", "confidence"))}
    assert set(dflash.model.state_dict()) == shared  # the same backbone, nothing else


@pytest.mark.parametrize("k", [8, None])
def test_targets_from_the_extracted_top_k_are_the_lm_heads(tiny_target, samples, k):
    """A batch built from the samples' top-k equals the frozen lm_head's rebuild on the k most
    likely tokens and nowhere else (all of it at k = the vocabulary), with the same labels."""
    k = k or tiny_target.vocab_size
    cap = HiddenStateCapture(tiny_target, [0, 1], "float32", topk=k)
    with_topk = [
        cap.package(s.sample_id, s.input_ids, s.loss_mask, {0: s.aux_hidden[0], 1: s.last_hidden})
        for s in samples[:3]
    ]
    cap.close()
    draft_ids = build_draft_ids(count_tokens(samples, tiny_target.vocab_size), 256)
    head = TargetHead(tiny_target.norm, tiny_target.lm_head, draft_ids)
    exact, fast = collate(samples[:3], head), collate(with_topk, head)
    assert exact.p_ids is None and fast.p_ids.shape == (*fast.valid.shape, k)  # sparse: [B, S, k]
    assert torch.equal(exact.valid, fast.valid)
    p_fast = fast.dense_p(draft_ids.numel())
    kept = p_fast > 0
    torch.testing.assert_close(p_fast[kept], exact.p_target[kept], rtol=1e-5, atol=1e-7)
    if k == tiny_target.vocab_size:
        torch.testing.assert_close(p_fast, exact.p_target, rtol=1e-5, atol=1e-7)
    else:
        assert 0 < int(kept.sum(-1).max()) <= k
    has = fast.labels >= 0  # a position whose k best hold no draft token has no label
    assert bool(has[exact.valid].any()) and torch.equal(fast.labels[has], exact.labels[has])
    assert bool((fast.labels[exact.valid & ~has] == -1).all())
    # The target's greedy token is its top-1 over the whole vocabulary, which every k holds.
    assert torch.equal(fast.greedy, exact.greedy)
    # Where it is no draft token, greedy decoding can never accept, though CE has a label.
    outside = exact.valid & (exact.greedy == -1)
    assert bool(outside.any()) and bool((exact.labels[outside] >= 0).all())


def test_the_block_drafts_take_the_sweep_levers_kv_heads_and_kl(
    smoke_params, tiny_target, samples, tmp_path
):
    """train.dspark.num_kv_heads widens both block drafts' attention (and their export);
    kl_weight adds the forward KL to DSpark's loss and, set apart, to DFlash's."""
    from dspark.config import Params
    from dspark.errors import ConfigError

    heads = tiny_target.model.config.num_attention_heads
    tree = tiny_params(smoke_params).model_dump()
    tree["train"]["dspark"].update(num_kv_heads=heads, kl_weight=0.5)
    tree["train"]["dflash"].update(kl_weight=2.0)
    params = Params.model_validate(tree)
    draft_ids = build_draft_ids(count_tokens(samples, tiny_target.vocab_size), 256)
    runs = {r.name: r for r in build_runs(params, tiny_target, draft_ids, [0, 1], mask_id=3)}
    for name in ("dspark", "dflash"):
        s = runs[name].model.cfg.layer
        assert s.num_kv_heads == heads, name
        assert runs[name].model.layers[0].self_attn.k_proj.out_features == heads * s.head_dim
    eagle3_kv = runs["eagle3"].model.cfg.layer.num_kv_heads
    assert eagle3_kv == tiny_target.model.config.num_key_value_heads  # its own, untouched
    assert runs["dspark"].objective.weights.kl == 0.5 and runs["dflash"].objective.weights.kl == 2.0

    batch = collate(samples[:2], TargetHead(tiny_target.norm, tiny_target.lm_head, draft_ids))
    out = runs["dspark"].objective(runs["dspark"].model, batch, torch.Generator().manual_seed(0))
    parts = 0.1 * out["loss_ce"] + params.train.dspark.tv_weight * out["loss_tv"]
    parts = parts + 0.5 * out["loss_kl"] + out["loss_confidence"]
    assert float(out["loss_kl"]) > 0.0 and torch.allclose(out["loss"], parts)

    model = runs["dspark"].model
    doc, back, _ = exported_back(model, draft_ids, tiny_target, tmp_path / "wide")
    assert doc["transformer_layer_config"]["num_key_value_heads"] == heads
    assert back.cfg == model.cfg and roundtrip_diff(model, back) == 0.0

    own = tiny_target.model.config.num_key_value_heads  # DFlash may keep the target's
    tree["train"]["dflash"]["num_kv_heads"] = own
    runs = build_runs(Params.model_validate(tree), tiny_target, draft_ids, [0, 1], mask_id=3)
    assert [r.model.cfg.layer.num_kv_heads for r in runs] == [heads, own, own]

    for draft in ("dflash", "dspark"):
        tree["train"][draft]["num_kv_heads"] = heads + 1
        with pytest.raises(ConfigError, match=rf"train\.{draft}\.num_kv_heads"):
            build_runs(Params.model_validate(tree), tiny_target, draft_ids, [0, 1], mask_id=3)


def test_the_qk_norm_gains_start_where_the_recipe_says(smoke_params, tiny_target, samples):
    """train.dspark.qk_norm_init starts both block drafts' q_norm and k_norm gains there, and
    DFlash's unless train.dflash sets its own (the gains are weights: export carries them)."""
    from dspark.config import Params

    tree = tiny_params(smoke_params).model_dump()
    draft_ids = build_draft_ids(count_tokens(samples, tiny_target.vocab_size), 256)

    def gains(tree) -> dict[str, set[float]]:
        runs = build_runs(Params.model_validate(tree), tiny_target, draft_ids, [0, 1], mask_id=3)
        return {
            r.name: {
                float(w)
                for layer in r.model.layers
                for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm)
                for w in norm.weight
            }
            for r in runs
            if r.name != "eagle3"
        }

    assert gains(tree) == {"dspark": {1.0}, "dflash": {1.0}}
    tree["train"]["dspark"]["qk_norm_init"] = 2.0
    assert gains(tree) == {"dspark": {2.0}, "dflash": {2.0}}
    tree["train"]["dflash"]["qk_norm_init"] = 1.5
    assert gains(tree) == {"dspark": {2.0}, "dflash": {1.5}}


def test_the_context_scale_is_the_first_batchs_rms_and_export_folds_it(
    smoke_params, tiny_target, samples, tmp_path
):
    from dspark.train.sources import epoch_plan

    params = tiny_params(smoke_params, dspark={"context_scale": True}, max_steps=1)
    ids = [s.sample_id for s in samples]
    train_ids, eval_ids = ids[2:], ids[:2]
    trainer = make_trainer(params, tiny_target, samples, tmp_path / "ckpt")
    trainer.fit(memory_source(samples), train_ids, eval_ids)

    c = params.train
    first = epoch_plan(train_ids, 0, c.seed, c.batch_size, c.shuffle_window)[0]
    feats = torch.cat(
        [samples[i].aux_hidden.float().permute(1, 0, 2).flatten(1) for i in first]
    ).double()
    want = 1.0 / feats.pow(2).mean(0).sqrt()  # [L*H] per channel, over the batch's tokens
    runs = {r.name: r.model for r in trainer.runs}
    for name in ("dspark", "dflash"):  # the block drafts share it; EAGLE-3 has its own input norm
        assert torch.allclose(runs[name].aux_scale.double(), want, rtol=1e-5), name
    assert not torch.allclose(want, torch.ones_like(want)) and not hasattr(
        runs["eagle3"], "aux_scale"
    )

    model = runs["dspark"]
    _, back, _ = exported_back(model, trainer.head.draft_ids, tiny_target, tmp_path / "export")
    assert "aux_scale" not in load_file(tmp_path / "export" / "model.safetensors")
    assert back.cfg.context_scale is False  # speculators' plain fc, the scale inside it
    assert roundtrip_diff(model, back) < 1e-4


def test_the_last_evaluation_is_also_measured_per_validation_source(
    smoke_params, tiny_target, samples, tmp_path
):
    """data.val_sources: each source's held-out samples are measured on their own at the end;
    the pooled figure stays the draft's tau_sim."""
    params = tiny_params(smoke_params)
    ids = [s.sample_id for s in samples]
    sources = {0: "code", 1: "code", 2: "sharegpt", 3: "sharegpt"}
    trainer = make_trainer(params, tiny_target, samples, tmp_path, eval_sources=sources)
    trainer.fit(memory_source(samples), ids[4:], ids[:4])
    by_id = {s.sample_id: s for s in samples}
    for run in trainer.runs:
        assert sorted(run.by_source) == ["code", "sharegpt"]
        for name in run.by_source:
            group = [by_id[i] for i, n in sources.items() if n == name]
            alone = run.measure([collate(group, trainer.head)])
            assert run.by_source[name]["tau_sim"] == alone["tau_sim"] is not None
            assert run.by_source[name]["tau_greedy"] == alone["tau_greedy"] is not None
        pooled = [collate([by_id[0], by_id[1]], trainer.head)]
        pooled.append(collate([by_id[2], by_id[3]], trainer.head))
        assert run.last_eval == run.measure(pooled)
    figures = summarize(trainer.runs, trainer.tokens)
    assert (
        figures["dspark"]["by_source"]["code"]["tau_sim"]
        == trainer.runs[0].by_source["code"]["tau_sim"]
    )
    dspark = figures["dspark"]
    assert (
        dspark["by_source"]["code"]["tau_greedy"] == trainer.runs[0].by_source["code"]["tau_greedy"]
    )
    assert 1.0 <= dspark["tau_greedy"] <= 1 + params.train.dspark.block_size
    assert len(dspark["pos_greedy"]) == params.train.dspark.block_size
    # every held-out point: [wall_s, tokens, tau_sim, tau_greedy]
    assert [len(point) for point in dspark["curve"]] == [4] * len(dspark["curve"])
    assert dspark["curve"][-1][2:] == [dspark["tau_sim"], dspark["tau_greedy"]]
    # the sweep's default ranking key is one this file carries, with a value
    assert 1.0 <= _dig(figures, DEFAULT_METRIC) <= 1 + params.train.dspark.block_size


def test_the_block_study_levers_reach_both_block_drafts_and_their_measure(
    smoke_params, tiny_target, samples
):
    """train.dspark's layout, block attention and feature input build DSpark (and DFlash unless
    it sets its own); a trained step and the held-out measure then run over the drafting slots
    only, with the per-slot conditional acceptance and the copy check beside them."""
    from dspark.config import Params

    tree = tiny_params(smoke_params).model_dump()
    tree["train"]["dspark"].update(
        sample_from_anchor=False, block_attention="causal", feature_input="first"
    )
    tree["train"]["dflash"].update(feature_input="all")
    params = Params.model_validate(tree)
    draft_ids = build_draft_ids(count_tokens(samples, tiny_target.vocab_size), 256)
    runs = {r.name: r for r in build_runs(params, tiny_target, draft_ids, [0, 1], mask_id=3)}
    block = params.train.dspark.block_size
    for name, feature in (("dspark", "first"), ("dflash", "all")):
        cfg = runs[name].model.cfg
        assert (cfg.sample_from_anchor, cfg.block_attention, cfg.feature_input) == (
            False,
            "causal",
            feature,
        )
        assert runs[name].slots == cfg.draft_slots == block - 1
    batch = collate(samples[:4], TargetHead(tiny_target.norm, tiny_target.lm_head, draft_ids))
    run = runs["dspark"]
    before = run.model.feature_fc.weight.detach().clone()
    metrics = run.step(batch, 0, 10, seed=0, prep_s=0.0)
    assert not torch.equal(run.model.feature_fc.weight, before)  # it learns from its zero start
    assert [f"accept_{k}" in metrics for k in range(block)] == [True] * (block - 1) + [False]
    held = run.measure([batch])
    assert len(held["pos_greedy"]) == len(held["cond_greedy"]) == block - 1
    assert held["cond_greedy"][0] == held["pos_greedy"][0]  # slot 0 has nothing before it
    copy = held["copy"]
    assert copy["blocks"] > 0 and 0.0 <= copy["draft_recent"] <= 1.0
    assert copy["draft_anchor"] <= copy["draft_recent"]  # the anchor is one of the recent


def test_train_lm_head_trains_the_block_drafts_head_and_keeps_it_in_the_export(
    smoke_params, tiny_target, samples, tmp_path
):
    """train.dspark.train_lm_head: DSpark's (and DFlash's, unless it sets its own) copy of the
    target's lm_head rows learns, where by default it stays the target's; the saved draft and
    its speculators export carry the learned rows; a full vocabulary, whose export takes the
    verifier's head, is refused."""
    from dspark.config import Params
    from dspark.errors import ConfigError

    tree = tiny_params(smoke_params).model_dump()
    tree["train"]["dspark"]["train_lm_head"] = True
    tree["train"]["dflash"]["train_lm_head"] = False
    params = Params.model_validate(tree)
    draft_ids = build_draft_ids(count_tokens(samples, tiny_target.vocab_size), 256)
    runs = {r.name: r for r in build_runs(params, tiny_target, draft_ids, [0, 1], mask_id=3)}
    batch = collate(samples[:4], TargetHead(tiny_target.norm, tiny_target.lm_head, draft_ids))
    target_rows = tiny_target.lm_head.weight[draft_ids]
    for name, learns in (("dspark", True), ("dflash", False), ("eagle3", False)):
        runs[name].step(batch, 0, 10, seed=0, prep_s=0.0)
        head = runs[name].model.lm_head.weight
        assert torch.equal(head, target_rows) is not learns, name
    dspark = runs["dspark"].model
    folder = tmp_path / "dspark"
    export_speculators(
        dspark,
        draft_ids,
        folder,
        verifier_config=tiny_target.model.config.to_dict(),
        verifier_path="t",
    )
    back, _ = import_speculators(folder, tiny_target.embed, tiny_target.lm_head)
    assert torch.equal(back.lm_head.weight, dspark.lm_head.weight)

    tree["train"]["draft_vocab_size"] = None
    every = torch.arange(tiny_target.vocab_size)
    with pytest.raises(ConfigError, match=r"train_lm_head: needs train\.draft_vocab_size"):
        build_runs(Params.model_validate(tree), tiny_target, every, [0, 1], mask_id=3)


@pytest.mark.parametrize("damage", ["truncate_weights", "flip_optimizer_byte", "no_state"])
def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_one(
    smoke_params, tiny_target, samples, tmp_path, caplog, damage
):
    """The newest checkpoint damaged on disk (a weights file cut short, a byte flipped in an
    optimizer file, its state gone): resume verifies it against the sizes and checksums
    state.json holds, says so on one line, continues from the previous one, and ends exactly
    where an uninterrupted run ends: every batch seen once, none lost."""
    params = tiny_params(smoke_params)  # checkpoints at steps 3 and 6 of 8
    ids = [s.sample_id for s in samples]
    train_ids, eval_ids = ids[2:], ids[:2]
    whole = make_trainer(params, tiny_target, samples, tmp_path / "a")
    whole.fit(memory_source(samples), train_ids, eval_ids)

    folder = tmp_path / "b"
    broken = make_trainer(params, tiny_target, samples, folder)
    with pytest.raises(KeyboardInterrupt):  # dies in step 7: checkpoints at 3 (previous) and 6
        broken.fit(memory_source(samples, fail_after=1 + 7), train_ids, eval_ids)
    previous = folder.with_name("b.previous")
    assert read_state(folder)["step"] == 6 and read_state(previous)["step"] == 3
    if damage == "truncate_weights":
        weights = folder / "dspark.safetensors"
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    elif damage == "flip_optimizer_byte":
        opt = folder / "eagle3.optim.safetensors"
        data = bytearray(opt.read_bytes())
        data[len(data) // 2] ^= 0x01
        opt.write_bytes(bytes(data))
    else:
        (folder / "state.json").unlink()

    caplog.set_level(logging.WARNING, logger="dspark.train")
    resumed = make_trainer(params, tiny_target, samples, folder)
    resumed.fit(memory_source(samples), train_ids, eval_ids)
    assert resumed.resumed_from == 3 and resumed.step == 8
    (line,) = [r.getMessage() for r in caplog.records if r.name == "dspark.train"]
    assert line.startswith(f"train: damaged checkpoint passed over ({folder}/")
    assert line.endswith(f"resuming from {previous} at step 3") and "\n" not in line
    for a, b in zip(whole.runs, resumed.runs, strict=True):
        sa, sb = a.model.state_dict(), b.model.state_dict()
        assert all(torch.equal(sa[k], sb[k]) for k in sa), f"{a.name} weights differ"
        assert [p[1:] for p in a.curve] == [p[1:] for p in b.curve]


def test_with_both_checkpoints_damaged_training_starts_over_and_says_why(
    smoke_params, tiny_target, samples, tmp_path, caplog
):
    params = tiny_params(smoke_params)
    ids = [s.sample_id for s in samples]
    folder = tmp_path / "b"
    broken = make_trainer(params, tiny_target, samples, folder)
    with pytest.raises(KeyboardInterrupt):
        broken.fit(memory_source(samples, fail_after=1 + 7), ids[2:], ids[:2])
    for f in (folder / "dspark.safetensors", folder.with_name("b.previous") / "dspark.safetensors"):
        f.write_bytes(b"")
    caplog.set_level(logging.WARNING, logger="dspark.train")
    again = make_trainer(params, tiny_target, samples, folder)
    assert again._resume() == (0, 0) and again.step == 0
    (line,) = [r.getMessage() for r in caplog.records if r.name == "dspark.train"]
    assert line.startswith("train: no undamaged checkpoint (") and line.endswith("starting over")
    assert "dspark.safetensors: 0 bytes" in line


def folder_bytes(folder) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def test_a_full_disk_stops_training_in_one_line_and_it_resumes_once_space_is_back(
    smoke_params, tiny_target, samples, tmp_path, small_disk
):
    """The checkpoint folder on a disk that holds one checkpoint and a half: the first
    (step 3) is written, the second (step 6, beside the kept previous one) runs out of space.
    Training stops with one line naming the folder and the bytes it needed and leaves nothing
    half-written; with space back it resumes from step 3 and ends where an uninterrupted run
    ends."""
    params = tiny_params(smoke_params)
    ids = [s.sample_id for s in samples]
    train_ids, eval_ids = ids[2:], ids[:2]
    whole = make_trainer(params, tiny_target, samples, tmp_path / "a")
    whole.fit(memory_source(samples), train_ids, eval_ids)
    size = folder_bytes(tmp_path / "a")

    disk = small_disk.mount(int(size * 1.5))
    folder = disk / "train"
    full = make_trainer(params, tiny_target, samples, folder)
    with pytest.raises(ResourceError) as e:
        full.fit(memory_source(samples), train_ids, eval_ids)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{folder}: no space left on the device (")
    assert "bytes to write" in msg and msg.endswith("it resumes where it stopped")
    assert sorted(p.name for p in disk.iterdir()) == ["train"]  # no temporary folder left
    assert read_state(folder)["step"] == 3

    small_disk.mount(size * 4)
    resumed = make_trainer(params, tiny_target, samples, folder)
    resumed.fit(memory_source(samples), train_ids, eval_ids)
    assert resumed.resumed_from == 3 and resumed.step == 8
    for a, b in zip(whole.runs, resumed.runs, strict=True):
        sa, sb = a.model.state_dict(), b.model.state_dict()
        assert all(torch.equal(sa[k], sb[k]) for k in sa), f"{a.name} weights differ"
