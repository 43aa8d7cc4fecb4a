"""The bundled nano model and SAE set: small, loadable offline, trained (beats the unigram baseline), SAEs reconstruct."""
from __future__ import annotations

import json
import math

import pytest
import torch

from qwen_scope.nano import NANO_DIR, NANO_RELEASE_DIR, load_nano, nano_corpus


@pytest.fixture(scope="module")
def nano():
    torch.set_num_threads(1)
    return load_nano()


@pytest.fixture(scope="module")
def sample_ids(nano):
    _, tokenizer = nano
    text = "\n".join(nano_corpus(4))[:2048]
    return tokenizer(text, return_tensors="pt").input_ids


def test_package_data_is_small_and_complete():
    files = [p for p in NANO_DIR.rglob("*") if p.is_file()]
    names = {p.name for p in files}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "corpus_sample.jsonl"} <= names
    assert sorted(p.name for p in NANO_RELEASE_DIR.glob("layer*.sae.pt")) == [f"layer{n}.sae.pt" for n in range(6)]
    assert sum(p.stat().st_size for p in files) < 10 * 2 ** 20


def test_nano_is_a_hybrid_qwen3_5_with_a_byte_tokenizer(nano):
    model, tokenizer = nano
    assert type(model).__name__ == "Qwen3_5ForCausalLM" and model.dtype == torch.float32
    types = model.config.layer_types
    assert len(types) == 6 and {"linear_attention", "full_attention"} == set(types)
    assert model.config.linear_num_value_heads > model.config.linear_num_key_heads       # GVA
    text = "def f(x):\n    return x  # é"
    assert tokenizer(text)["input_ids"] == list(text.encode("utf-8"))
    assert tokenizer.eos_token_id == 256


def test_nano_beats_the_unigram_baseline_on_held_out_text(nano, sample_ids):
    model, _ = nano
    with torch.no_grad():
        logits = model(input_ids=sample_ids).logits[0, :-1]
    loss = float(torch.nn.functional.cross_entropy(logits, sample_ids[0, 1:]))
    counts = torch.bincount(sample_ids[0], minlength=257).double()
    entropy = float(-(counts[counts > 0] / counts.sum() * (counts[counts > 0] / counts.sum()).log()).sum())
    # The unigram entropy of the text itself is a lower bound for any unigram model; the trained model is far below.
    assert loss < 0.6 * entropy, (loss, entropy)
    results = json.loads((NANO_RELEASE_DIR / "training.json").read_text())
    assert set(results["metrics"]) == {str(n) for n in range(6)}


def test_every_sae_loads_and_reconstructs_its_layer(nano, sample_ids):
    from saes import load
    from saes.training import evaluate_sae
    from saes.training_data import model_activations

    model, _ = nano
    acts = next(model_activations(model, [sample_ids], list(range(6))))
    for n in range(6):
        sae = load(NANO_RELEASE_DIR, n, dtype=torch.float32)
        assert (sae.d_model, sae.d_sae, sae.k) == (128, 1024, 16)
        metrics = evaluate_sae(sae, acts[n])
        assert metrics["fve"] > 0.6, (n, metrics)
        assert math.isclose(metrics["l0"], 16, abs_tol=0.5)
