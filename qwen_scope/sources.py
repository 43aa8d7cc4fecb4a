"""Where a model and a device come from, checked before any weights load: a missing or offline model, a guess like
``"nano"``, or ``cuda`` on a machine without it is one clear error naming the fix, not a trace from deep inside
transformers or torch.

    config = model_config("Qwen/Qwen3.5-2B-Base")   # FileNotFoundError naming `hf download ...` when not cached offline
    device = check_device("cuda")                   # ValueError on a machine without CUDA
    bar = progress_bar(total=n, unit="tok")         # a text bar in Jupyter without ipywidgets, with no warning
"""
from __future__ import annotations

import importlib.util
import logging
import os
import warnings
from pathlib import Path

import torch

from saes.loading import hub_unreachable

__all__ = ["check_device", "model_config", "progress_bar", "quiet_notebook_progress", "quiet_reference_kernel_advice"]

logger = logging.getLogger(__name__)

# One attempt of this many seconds tells whether the hub answers; huggingface_hub's own retries take ~29 s to give up.
HUB_PROBE_TIMEOUT_S = 5.0
# Names a user may try for the bundled nano model, which has no hub id.
_NANO_GUESSES = {"nano", "qwen-nano", "qwen3.5-nano", "qwen3.5-nano-base", "qwen/qwen3.5-nano"}


def _offline() -> bool:
    from huggingface_hub import constants

    flag = os.environ.get("HF_HUB_OFFLINE", "") or os.environ.get("TRANSFORMERS_OFFLINE", "")
    return flag.strip().lower() in ("1", "true", "yes", "on") or bool(constants.is_offline_mode())


def check_device(device: str | torch.device | None) -> torch.device:
    """The ``torch.device`` for ``device`` (default CPU), refusing a device this machine cannot run.

    Args:
        device: ``"cpu"``, ``"cuda"``, ``"cuda:1"``, a ``torch.device`` or None.
    Returns:
        the device.
    Raises:
        ValueError: an unknown device string, CUDA without a usable GPU, or a GPU index past the visible ones.

    Example:
        >>> check_device(None)
        device(type='cpu')
    """
    try:
        dev = torch.device(device if device is not None else "cpu")
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device {device!r} is not a torch device ({str(e).splitlines()[0]}); "
                         f"use 'cpu' or 'cuda'") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            why = ("this torch build has no CUDA" if torch.version.cuda is None
                   else "no CUDA GPU is visible to torch")
            raise ValueError(f"device {str(device)!r} asked for, but {why} (torch {torch.__version__}); "
                             f"use --device cpu (device='cpu')")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device {str(device)!r} asked for, but only {torch.cuda.device_count()} CUDA "
                             f"device(s) are visible; use cuda:0 .. cuda:{torch.cuda.device_count() - 1}")
    elif dev.type not in ("cpu", "meta"):
        raise ValueError(f"device {str(device)!r} is not supported here; use 'cpu' or 'cuda'")
    return dev


def _nano_hint(model_id: str) -> str | None:
    if Path(model_id).expanduser().exists() or model_id.strip().lower() not in _NANO_GUESSES:
        return None
    from qwen_scope.nano import NANO_DIR

    return (f"{model_id!r} is not a model id or directory. The bundled nano model is the directory {NANO_DIR} "
            f"(features, steer and demo use it when --model is left out; pass that path where a model is asked)")


def _cached(name: str, revision: str | None, cache_dir: str | Path | None) -> bool:
    from huggingface_hub import try_to_load_from_cache

    return isinstance(try_to_load_from_cache(name, "config.json", cache_dir=cache_dir, revision=revision), str)


def model_config(model_id: str | Path, *, revision: str | None = None, cache_dir: str | Path | None = None):
    """The model's transformers config, read before any weights so a missing model fails in a second, not after a
    download attempt or a long trace.

    Args:
        model_id: hub id or local directory (``save_pretrained`` output).
        revision, cache_dir: as for ``from_pretrained``.
    Returns:
        the ``PretrainedConfig``.
    Raises:
        FileNotFoundError: a directory without ``config.json``; a hub model not in the cache while offline, or
            online while the hub does not answer (one short attempt, not the hub client's retries), naming
            ``hf download <repo>``; a name that is neither (with the bundled nano model's path for "nano").

    Example:
        >>> model_config(NANO_DIR).get_text_config().num_hidden_layers
        6
    """
    from transformers import AutoConfig

    name = str(model_id)
    hint = _nano_hint(name)
    if hint:
        raise FileNotFoundError(hint)
    path = Path(name).expanduser()
    if not path.exists() and (name.startswith(("/", ".", "~")) or name.count("/") > 1):
        raise FileNotFoundError(f"model directory {name} does not exist; pass a directory written by save_pretrained "
                                f"or a hub id such as Qwen/Qwen3.5-2B-Base")
    if path.is_dir() and not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} has no config.json; expected a model directory written by save_pretrained "
                                f"(or a hub id such as Qwen/Qwen3.5-2B-Base)")
    if path.exists() and not path.is_dir():
        raise FileNotFoundError(f"{path} is a file; a model is a directory written by save_pretrained, or a hub id")
    offline = _offline()
    where = cache_dir or os.environ.get("HF_HUB_CACHE") or "the default hub cache"
    if not offline and not path.exists():
        reason = hub_unreachable(name, "config.json", revision, timeout=HUB_PROBE_TIMEOUT_S)
        if reason and not _cached(name, revision, cache_dir):
            raise FileNotFoundError(
                f"model {name} is not in {where} and the hub does not answer ({reason}). Fix: download it where "
                f"there is network (`hf download {name}`) and point HF_HUB_CACHE (cache_dir=) at that cache, or pass "
                f"a local model directory")
        if reason:
            logger.warning("the hub does not answer (%s); using the cached copy of %s", reason, name)
            offline = True
    try:
        return AutoConfig.from_pretrained(name, revision=revision, cache_dir=cache_dir, local_files_only=offline)
    except (OSError, ValueError) as e:
        if path.exists():
            raise FileNotFoundError(f"cannot read the config of {path}: {str(e).splitlines()[0]}") from None
        if offline:
            raise FileNotFoundError(
                f"model {name} is not in {where} and offline mode (HF_HUB_OFFLINE=1) is on. Fix: download it once "
                f"online (`hf download {name}`), pass cache_dir= / HF_HUB_CACHE pointing at the cache that holds it, "
                f"or pass a local model directory") from None
        raise FileNotFoundError(
            f"could not get model {name} from the hub ({str(e).splitlines()[0]}). Fix: check the id (e.g. "
            f"Qwen/Qwen3.5-2B-Base) and the network, or download it first (`hf download {name}`)") from None


class _DropReferenceKernelAdvice(logging.Filter):
    """Drops transformers' "falling back to its reference PyTorch implementation ... install X" notes.

    The reference path is the one that is correct on CPU, and the packages it names (flash-linear-attention,
    causal_conv1d) must not be installed on a CPU machine: with them present the CPU forward is routed into Triton and
    crashes. On the GPU the fused kernels of ``flashqla_kernels`` replace these layers instead.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return "falling back to its reference PyTorch implementation" not in record.getMessage()


_FILTER = _DropReferenceKernelAdvice()


def quiet_reference_kernel_advice() -> None:
    """Silence transformers' advice to install GDN kernel packages (see ``_DropReferenceKernelAdvice``); idempotent,
    and only this one kind of message is dropped."""
    logger = logging.getLogger("transformers.integrations.hub_kernels")
    if _FILTER not in logger.filters:
        logger.addFilter(_FILTER)


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        # A module blocked with sys.modules[name] = None has no spec to find.
        return False


def quiet_notebook_progress() -> None:
    """Without ipywidgets, ``tqdm.auto`` in Jupyter (transformers imports it with its first module) falls back to
    the text bar, which is right, but first warns "IProgress not found. Please update jupyter and ipywidgets": a red
    stderr box in every notebook, advising an optional extra. Drop that one warning; idempotent, and nothing changes
    where ipywidgets is importable (the widget bars are used). ``import qwen_scope`` calls it, before any of its
    modules imports transformers."""
    if not _importable("ipywidgets"):
        warnings.filterwarnings("ignore", message="IProgress not found", category=Warning)


def progress_bar(**kwargs):
    """A tqdm bar: the notebook widget where ipywidgets is importable, the text bar otherwise, never tqdm's advice to
    install ipywidgets.

    Args:
        **kwargs: passed to ``tqdm`` (``total``, ``unit``, ``disable``, ``desc``, ...).
    Returns:
        the bar.

    Example:
        >>> bar = progress_bar(total=10, disable=True)
    """
    if _importable("ipywidgets"):
        from tqdm.auto import tqdm
    else:
        from tqdm import tqdm
    return tqdm(**kwargs)
