"""Models and devices are checked before weights load: each bad one is a single error naming the fix."""
from __future__ import annotations

import logging

import pytest
import torch

from qwen_scope.nano import NANO_DIR
from qwen_scope.sources import check_device, model_config, progress_bar, quiet_reference_kernel_advice


def test_devices_this_machine_can_run_pass_and_others_name_the_fix():
    assert check_device(None) == torch.device("cpu") and check_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match=r"device 'gpu' is not a torch device .*use 'cpu' or 'cuda'"):
        check_device("gpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"device 'cuda:0' asked for, but .*use --device cpu"):
            check_device("cuda:0")


@pytest.mark.parametrize("name, message", [
    ("nano", r"'nano' is not a model id or directory\. The bundled nano model is the directory .*data/nano"),
    ("Qwen/Qwen3.5-9B-Nope", r"model Qwen/Qwen3\.5-9B-Nope is not in .* offline .*`hf download Qwen/Qwen3\.5-9B-Nope`"),
    ("./no/such/model", r"model directory \./no/such/model does not exist"),
])
def test_missing_models_are_named_with_the_fix(name, message, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match=message):
        model_config(name)


def test_a_local_model_is_read_from_its_config_and_a_file_or_empty_dir_is_refused(tmp_path):
    assert model_config(NANO_DIR).get_text_config().num_hidden_layers == 6
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        model_config(tmp_path)
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(FileNotFoundError, match="is a file"):
        model_config(tmp_path / "weights.bin")


def test_only_the_reference_kernel_advice_is_silenced(caplog):
    quiet_reference_kernel_advice()
    quiet_reference_kernel_advice()
    logger = logging.getLogger("transformers.integrations.hub_kernels")
    assert len(logger.filters) == len(set(map(id, logger.filters)))
    with caplog.at_level(logging.WARNING, logger=logger.name):
        logger.warning("`chunk_gated_delta_rule` is falling back to its reference PyTorch implementation because "
                       "`flash-linear-attention` is not installed.")
        logger.warning("some other warning")
    assert [r.getMessage() for r in caplog.records] == ["some other warning"]


def test_progress_bars_are_plain_text_and_quiet_without_ipywidgets(monkeypatch, recwarn, capsys):
    import tqdm

    monkeypatch.setitem(__import__("sys").modules, "ipywidgets", None)
    bar = progress_bar(total=3, disable=True)
    assert type(bar) is tqdm.tqdm
    assert not recwarn.list and capsys.readouterr().err == ""


class _NoNetwork:
    """A hub HTTP session whose every request fails as without network, counting the attempts."""

    def __init__(self):
        self.calls = 0

    def request(self, *args, **kwargs):
        import httpx2

        self.calls += 1
        raise httpx2.ConnectError("[Errno 101] Network is unreachable")

    def stream(self, *args, **kwargs):
        return self.request()


def test_online_without_network_a_model_not_cached_fails_at_once_naming_the_download(monkeypatch, tmp_path):
    import time

    import huggingface_hub.constants
    import huggingface_hub.utils._http as hub_http

    from tests.fake_hub import snapshot_dir

    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(var, "0")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    session = _NoNetwork()
    monkeypatch.setattr(hub_http, "get_session", lambda: session)
    start = time.perf_counter()
    with pytest.raises(FileNotFoundError, match=r"^model Qwen/Qwen3\.5-9B-Base is not in .* the hub does not answer "
                                                r"\(ConnectError: .*unreachable\)\. Fix: .*`hf download Qwen/Qwen3\.5-9B-Base`"):
        model_config("Qwen/Qwen3.5-9B-Base", cache_dir=tmp_path)
    assert time.perf_counter() - start < 3 and session.calls == 1
    # A cached model loads from the cache instead, with the same single attempt.
    (snapshot_dir(tmp_path, "Qwen/Qwen3.5-9B-Base") / "config.json").write_text(
        model_config(NANO_DIR).to_json_string())
    assert model_config("Qwen/Qwen3.5-9B-Base", cache_dir=tmp_path).get_text_config().num_hidden_layers == 6
    assert time.perf_counter() - start < 6 and session.calls == 2
