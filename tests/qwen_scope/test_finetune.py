"""Fine-tuning with a feature penalty on the nano model: the penalised feature goes off on held-out documents while
the held-out LM loss stays within 5% (and without the penalty the feature stays on); runs repeat exactly for a seed,
gradient accumulation and checkpointing give the same steps; every bad input is an error naming the fix; the
example script (examples/feature_penalty_finetune.py) runs on it."""
from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

from qwen_scope import FeaturePenalty, nano_corpus, nano_scope
from qwen_scope.applications.finetune import FinetuneConfig, _penalties, _train, finetune, pack_texts
from qwen_scope.nano import NANO_RELEASE_DIR

# Layer 4's #229 fires on the indentation after a newline in Python code (mean 0.19, on 10% of held-out tokens).
LAYER, FEATURE = 4, 229
FAST = dict(steps=6, lr=3e-4, max_eval_rows=32)


@pytest.fixture(scope="module")
def split():
    docs = nano_corpus()
    return [d for i, d in enumerate(docs) if i % 4], docs[::4]


@pytest.fixture(scope="module")
def nano():
    """One scope for the module and its shipped weights, loaded back before each run (a run trains in place)."""
    scope = nano_scope([LAYER])
    return scope, {k: v.clone() for k, v in scope.model.state_dict().items()}


def _run(nano, split, features=None, **cfg):
    scope, shipped = nano
    scope.model.load_state_dict(shipped)
    return finetune(scope, *split, features or {LAYER: FEATURE}, FinetuneConfig(**cfg), progress=False)


def test_the_penalty_switches_the_feature_off_on_held_out_text_within_the_lm_loss_margin(nano, split):
    pen, plain = (_run(nano, split, weight=w, **FAST) for w in (1.0, 0.0))
    print(pen.table(), plain.table(), sep="\n")
    before, after = pen.before.reading(LAYER, FEATURE), pen.after.reading(LAYER, FEATURE)
    assert before.mean > 0.1 and before.rate > 0.05, before  # the feature fires on the held-out documents
    assert after.mean <= 0.5 * before.mean and after.rate <= 0.5 * before.rate, pen.table()
    assert pen.after.lm_loss <= 1.05 * pen.before.lm_loss, pen.table()  # held-out LM loss within +5%
    control = plain.after.reading(LAYER, FEATURE)
    assert control.mean > 0.75 * before.mean, plain.table()  # plain fine-tuning leaves it on
    assert pen.before == plain.before and len(pen.lm_losses) == len(pen.penalties) == FAST["steps"]
    model = nano[0].model
    assert not model.training and not any(m._forward_hooks for m in model.modules())


def test_a_seed_repeats_exactly_and_accumulation_and_checkpointing_give_the_same_steps(nano, split):
    cfg = dict(steps=2, lr=1e-3, max_eval_rows=4, eval_batch_size=4)
    a, b = _run(nano, split, **cfg), _run(nano, split, **cfg)
    assert a == b
    accumulated = _run(nano, split, batch_size=4, grad_accum=2, **cfg)
    checkpointed = _run(nano, split, gradient_checkpointing=True, **cfg)
    assert not any(getattr(m, "gradient_checkpointing", False) for m in nano[0].model.modules())  # switched off again
    for other in (accumulated, checkpointed):
        assert other.lm_losses == pytest.approx(a.lm_losses, rel=1e-4)
        assert other.penalties == pytest.approx(a.penalties, rel=1e-3, abs=1e-6)
        assert other.after.lm_loss == pytest.approx(a.after.lm_loss, rel=1e-4)
    bf16 = _run(nano, split, precision="bf16", **cfg)
    assert math.isfinite(bf16.after.lm_loss) and bf16.after.lm_loss == pytest.approx(a.after.lm_loss, rel=0.05)


def test_penalties_at_several_layers_add_up_and_each_feature_is_read(nano, split):
    scope = nano[0]
    scope.load_saes(NANO_RELEASE_DIR, [3])
    try:
        three, four = FeaturePenalty(scope.sae(3), 3, 849), FeaturePenalty(scope.sae(4), 4, [FEATURE, 885])
        cfg = dict(steps=1, max_eval_rows=4, eval_batch_size=4)
        both = _run(nano, split, [three, four], **cfg)
        alone = [_run(nano, split, [p], **cfg).penalties[0] for p in (three, four)]
    finally:
        del scope.saes[3]
    assert both.penalties[0] == pytest.approx(sum(alone), rel=1e-5)  # the first step's penalty: before any update
    assert [(r.layer, r.feature) for r in both.before.features] == [(3, 849), (4, FEATURE), (4, 885)]
    assert "layer 3 #849 mean activation" in both.table() and "layer 4 #885 firing rate" in both.table()


def test_bad_layers_features_text_and_settings_name_the_fix(nano, split):
    def run(features, texts=split, **cfg):
        return finetune(nano[0], *texts, features, FinetuneConfig(steps=1, **cfg), progress=False)

    with pytest.raises(ValueError, match=r"penalty layer 9 is out of range: .* has decoder blocks 0\.\.5; use one "
                                         r"of the layers with an SAE loaded, \[4\]"):
        run({9: FEATURE})
    with pytest.raises(ValueError, match=r"no SAE at penalty layer 2: the scope has SAEs at layers \[4\]; load one "
                                         r"first with scope.load_saes\(release, \[2\]\)"):
        run({2: FEATURE})
    with pytest.raises(ValueError, match=r"feature ids \[1024\] are outside the SAE's 0\.\.1023 \(layer 4, d_sae "
                                         r"1024\); pick ids below 1024"):
        run({LAYER: [FEATURE, 1024]})
    with pytest.raises(ValueError, match="no features to penalise"):
        run({})
    with pytest.raises(ValueError, match=r"held_out_texts hold 5 tokens, fewer than one row of seq_len 128; pass more "
                                         r"text or a smaller FinetuneConfig\(seq_len=\.\.\.\)"):
        run({LAYER: FEATURE}, (split[0], ["short"]))
    with pytest.raises(ValueError, match=r"train_texts pack into 1 row\(s\) of 128 tokens, fewer than batch_size 8"):
        run({LAYER: FEATURE}, (["x" * 200], split[1]))
    with pytest.raises(ValueError, match="FinetuneConfig.precision must be one of"):
        FinetuneConfig(precision="fp16")
    with pytest.raises(ValueError, match=r"FinetuneConfig.grad_accum must be an int >= 1, got 0"):
        FinetuneConfig(grad_accum=0)


def test_texts_pack_into_full_rows_with_end_of_text_between_documents(nano):
    scope = nano[0]
    rows = pack_texts(scope.tokenizer, ["abc", "de"], 3)
    eos = scope.tokenizer.eos_token_id
    assert rows.tolist() == [[97, 98, 99], [eos, 100, 101]]  # the last row's tail (eos) is dropped


def test_the_example_script_prints_the_table_on_the_nano_model(capsys):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
    import feature_penalty_finetune as example

    assert example.main(["--steps", "1", "--max-eval-rows", "4", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "the nano model: 1 steps of 8 x 128 tokens" in out and "layer 4 #229 firing rate" in out
    with pytest.raises(SystemExit):
        example.parse_args(["--model", "Qwen/Qwen3.5-2B-Base", "--release", "qwen-scope-3.5-2b-base-w32k-l50"])
    assert "--model needs --layer and --feature" in capsys.readouterr().err


def test_under_bf16_each_weight_is_cast_once_a_step_whatever_the_micro_batches(nano, split):
    from torch.utils._python_dispatch import TorchDispatchMode

    scope = nano[0]
    shapes = {tuple(m.weight.shape) for m in scope.model.modules() if isinstance(m, torch.nn.Linear)}

    class Casts(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            src = args[0] if args else None
            if (func is torch.ops.aten._to_copy.default and isinstance(src, torch.Tensor) and src.requires_grad
                    and src.dtype == torch.float32 and kwargs.get("dtype") == torch.bfloat16
                    and tuple(src.shape) in shapes):
                self.n += 1
            return func(*args, **kwargs)

    counts = []
    for accum in (1, 3):
        cfg = FinetuneConfig(steps=1, batch_size=2, grad_accum=accum, precision="bf16", max_eval_rows=2,
                             eval_batch_size=2)
        rows = pack_texts(scope.tokenizer, split[0], cfg.seq_len)
        with Casts() as casts:
            _train(scope, rows, _penalties(scope, {LAYER: FEATURE}), cfg, False)
        counts.append(casts.n)
    assert counts[0] > 0 and counts[1] == counts[0], counts
