"""Feature explanations end to end with a tiny random chat model built here (its text is meaningless; the pipeline,
the stored results and the AUROC arithmetic are checked against values computed by hand), and the HTTP backend
against a local fake server."""
from __future__ import annotations

import json
import math
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest
import torch

from qwen_scope.evals import OpenAIChat, TransformersChat, auroc, explain_features, judge_prompt
from qwen_scope.evals.explain import split_examples
from qwen_scope.explore import Chunk, FeatureDatabase, build_feature_database, feature_card, feature_json
from tests.factories import tiny_model, tiny_tokenizer

TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
D_SAE, N, K = 16, 600, 3


@pytest.fixture(scope="module")
def chat():
    tok = tiny_tokenizer()
    tok.chat_template = TEMPLATE
    return TransformersChat(tiny_model("qwen3", seed=3), tok, batch_size=16)


def _db(tmp_path=None) -> FeatureDatabase:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(97, 123, (N,), generator=g)
    values = torch.rand(N, K, generator=g) * 3 + 0.1
    indices = torch.stack([torch.randperm(D_SAE, generator=g)[:K] for _ in range(N)])
    chunk = Chunk(tokens, torch.arange(N) // 50, torch.arange(N) % 50, (values, indices), 0)
    db = build_feature_database([chunk], D_SAE, n_top=6, n_bins=3, per_bin=3, context=(4, 2))
    if tmp_path is not None:
        db.save(tmp_path)
    return db


def test_auroc_counts_ordered_pairs_with_ties_half():
    assert auroc([0.9, 0.4, 0.4, 0.1], [True, True, False, False]) == 0.875  # (1 + 1 + 0.5 + 1) / 4
    assert auroc([0.1, 0.2], [True, False]) == 0.0 and auroc([0.3, 0.3], [False, True]) == 0.5
    with pytest.raises(ValueError, match="positive and negative"):
        auroc([0.5], [True])


def test_explanations_end_to_end(chat, tmp_path):
    db = _db(tmp_path)
    out = explain_features(db, [2, 5, 11], chat, decode=chat.tokenizer, n_explain=4, n_holdout=3,
                           max_new_tokens=10, progress=False)
    assert sorted(out) == [2, 5, 11]
    for f, e in out.items():
        # The pipeline's judgements are the model's P(yes) on the judge prompts, rebuilt here by hand.
        _, held, negatives = split_examples(db, f, 4, 3, torch.Generator().manual_seed(f))
        assert len(held) == 3 and len(negatives) == 3
        asks = [judge_prompt(e.text, [chat.tokenizer.decode([t]) for t in x.tokens], x.mark)
                for x in held + negatives]
        batch = chat.tokenizer([chat.tokenizer.apply_chat_template(a, tokenize=False, add_generation_prompt=True)
                                for a in asks], add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            probs = [chat.model(input_ids=torch.tensor([ids])).logits[0, -1].softmax(-1) for ids in batch]
        yes = [float(p[chat.yes_ids].sum() / (p[chat.yes_ids].sum() + p[chat.no_ids].sum())) for p in probs]
        assert [p for _, p in e.scores] == pytest.approx(yes, abs=1e-5)
        assert [y for y, _ in e.scores] == [True] * 3 + [False] * 3
        wins = sum((a > b) + 0.5 * (a == b) for a in yes[:3] for b in yes[3:])
        assert e.detection_auroc == pytest.approx(wins / 9)
        assert db.explanation(f) == {"text": e.text, "detection_auroc": e.detection_auroc,
                                     "explainer": chat.name}
    # Stored on disk, searchable, exported.
    again = FeatureDatabase.load(tmp_path)
    assert again.explanation(5)["text"] == out[5].text and out[5].text
    assert 5 in again.search(out[5].text)
    exported = feature_json(feature_card(again, 5, decode=chat.tokenizer))["explanations"]
    assert exported[-1]["description"] == out[5].text
    assert exported[-1]["scores"][0]["value"] == pytest.approx(out[5].detection_auroc)


def test_a_rerun_skips_what_this_explainer_explained(chat):
    db = _db()
    first = explain_features(db, [1, 3], chat, decode=chat.tokenizer, n_explain=3, n_holdout=2, max_new_tokens=6,
                             progress=False)
    assert explain_features(db, [1, 3, 4], chat, decode=chat.tokenizer, n_explain=3, n_holdout=2, max_new_tokens=6,
                            progress=False).keys() == {4}
    redo = explain_features(db, [1], chat, decode=chat.tokenizer, n_explain=3, n_holdout=2, max_new_tokens=6,
                            progress=False, overwrite=True)
    assert redo[1] == first[1]  # deterministic


def test_an_explainer_without_a_chat_template_is_refused():
    with pytest.raises(ValueError, match="no chat template.*chat / instruct model"):
        TransformersChat(tiny_model("qwen3"), tiny_tokenizer())


class _FakeServer(BaseHTTPRequestHandler):
    requests: list = []

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).requests.append(body)
        if body.get("logprobs"):
            top = [{"token": "Yes", "logprob": -0.5}, {"token": " no", "logprob": -1.5}, {"token": "x", "logprob": -3}]
            choice = {"message": {"content": "Yes"}, "logprobs": {"content": [{"token": "Yes", "top_logprobs": top}]}}
        else:
            choice = {"message": {"content": " fires on the letter q\nmore"}}
        data = json.dumps({"choices": [choice]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


def test_the_openai_compatible_backend_over_http():
    server = HTTPServer(("127.0.0.1", 0), _FakeServer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        chat = OpenAIChat(f"http://127.0.0.1:{server.server_port}/v1", "served-model", api_key="k")
        db = _db()
        out = explain_features(db, [7], chat, decode=tiny_tokenizer(), n_explain=3, n_holdout=2, progress=False)
        assert out[7].text == "fires on the letter q"
        # P(yes) = e^-0.5 / (e^-0.5 + e^-1.5) for every judged example: all tie, so AUROC 0.5.
        p = 1 / (1 + math.exp(-1.0))
        assert [s for _, s in out[7].scores] == pytest.approx([p] * 4) and out[7].detection_auroc == 0.5
        assert _FakeServer.requests[0]["model"] == "served-model" and len(_FakeServer.requests) == 5
    finally:
        server.shutdown()
        server.server_close()
    with pytest.raises(OSError, match="cannot reach .* start the server"):
        OpenAIChat(f"http://127.0.0.1:{server.server_port}/v1", "m", timeout=2).complete([[]])
