"""Load Qwen-Scope SAE files safely: from the Hugging Face hub cache, a release directory, or a single file.

Every ``.pt`` goes through ``torch.load(weights_only=True)`` (a pickle carrying code is refused, never run), then the
keys and shapes are validated against the release before any ``TopKSAE`` exists. An optional conversion cache writes
each layer once as safetensors (bf16 or fp32) and memory-maps it on later loads.
"""
from __future__ import annotations

import hashlib
import logging
import os
import pickle
import re
import threading
import uuid
import warnings
from pathlib import Path

import torch

from saes.registry import Release, get_release, layer_index, list_releases
from saes.topk import RELEASE_KEYS, TopKSAE, _check_release_shapes

logger = logging.getLogger(__name__)

_LAYER_RE = re.compile(r"layer(\d+)\b")
_HUB_DIR_RE = re.compile(r"^models--(?P<org>[^-][\w.-]*?)--(?P<name>SAE-Res-.+)$")


class SAEFileError(ValueError):
    """An SAE file could not be used: refused, truncated, missing keys, wrong shapes or sizes."""


# ---------------------------------------------------------------------------------------------------- resolution
def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def _release_from_path(path: Path) -> Release | None:
    """The release a local file/dir belongs to, from its own or an ancestor's name (hub cache dirs included)."""
    for part in [path, *path.parents]:
        name = part.name
        hub = _HUB_DIR_RE.match(name)
        candidate = f"{hub['org']}/{hub['name']}" if hub else name
        if "SAE-Res-" not in candidate:
            continue
        try:
            return get_release(candidate)
        except ValueError:
            continue
    return None


# One short request tells a hub that answers from one that does not; the hub client's own retries would make a user
# without network wait about half a minute for the same error.
HUB_PROBE_TIMEOUT_S = 3.0


def hub_unreachable(repo_id: str, filename: str, revision: str | None,
                    timeout: float = HUB_PROBE_TIMEOUT_S) -> str | None:
    """Why the hub does not answer for ``filename`` of ``repo_id`` (one request of at most ``timeout`` seconds), or
    None when it answered (an answer such as "no such file" is left to the download, which names it)."""
    from huggingface_hub import get_hf_file_metadata, hf_hub_url
    from huggingface_hub.errors import HfHubHTTPError

    try:
        get_hf_file_metadata(hf_hub_url(repo_id, filename, revision=revision), timeout=timeout)
    except HfHubHTTPError:
        return None
    except Exception as e:  # noqa: BLE001 - connection refused, DNS, timeout, proxy, TLS: no hub either way
        return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"
    return None


def _hub_file(release: Release, layer: int, revision: str | None, cache_dir: str | Path | None) -> Path:
    """Path of ``layer{n}.sae.pt`` in the HF cache: the cached file as it is, else a download unless offline mode is
    on or the hub does not answer one short request."""
    import huggingface_hub
    from huggingface_hub import constants
    from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError, RepositoryNotFoundError

    filename = release.filename(layer)
    cache_dir = cache_dir or os.environ.get("HF_HUB_CACHE") or None
    offline = _env_true("HF_HUB_OFFLINE") or constants.is_offline_mode()
    where = cache_dir or constants.HF_HUB_CACHE
    fix = (f"Fix: download it once online (`hf download {release.repo_id} {filename}`), pass cache_dir= pointing at "
           f"the cache that holds it, or pass a local directory/file to load().")
    cached = huggingface_hub.try_to_load_from_cache(release.repo_id, filename, cache_dir=cache_dir, revision=revision)
    if isinstance(cached, str):
        return Path(cached)
    if not offline:
        down = hub_unreachable(release.repo_id, filename, revision)
        if down:
            raise FileNotFoundError(
                f"could not get {filename} of {release.repo_id} (revision {revision or 'main'}): it is not in cache "
                f"{where} and the hub did not answer ({down}). {fix}")
    try:
        path = huggingface_hub.hf_hub_download(release.repo_id, filename, revision=revision, cache_dir=cache_dir,
                                               local_files_only=offline)
    except (LocalEntryNotFoundError, EntryNotFoundError, RepositoryNotFoundError) as e:
        mode = "offline mode (HF_HUB_OFFLINE=1) is on and it is not cached" if offline else f"{type(e).__name__}"
        raise FileNotFoundError(
            f"could not get {filename} of {release.repo_id} (revision {revision or 'main'}): {mode}; looked in "
            f"cache {where}. {fix}") from e
    return Path(path)


def resolve(source: str | Path, layer: int | None, *, revision: str | None = None,
            cache_dir: str | Path | None = None, k: int | None = None) -> tuple[Path, Release | None, int, int]:
    """Find the file for ``(source, layer)``; return ``(path, release_or_None, layer, k)``.

    Args:
        source: release id, repo id, release directory (``layer{n}.sae.pt`` inside) or a single file.
        layer: layer index; may be ``None`` for a single file named ``layer{n}...``.
        revision, cache_dir: passed to huggingface_hub for hub sources.
        k: required when neither the name nor the registry gives it; must agree with it otherwise.
    """
    path = Path(source).expanduser() if isinstance(source, (str, Path)) else None
    if path is not None and path.exists():
        release = _release_from_path(path)
        if path.is_dir():
            if layer is None:
                raise TypeError(f"load({str(path)!r}, layer): a directory needs a layer index")
            layer = release.check_layer(layer) if release else _check_int_layer(layer)
            pt = path / Release.filename(layer)
            # saes.training can write safetensors-only release directories; the .pt name stays the default.
            st = pt.with_name(f"layer{layer}.sae.safetensors")
            path = pt if pt.is_file() or not st.is_file() else st
            if path.is_dir():
                raise SAEFileError(f"{path} is a directory, expected an SAE file (layer{{n}}.sae.pt or .safetensors)")
            if not path.is_file():
                have = sorted(p.name for p in path.parent.glob("layer*.sae.*"))[:8]
                raise FileNotFoundError(f"{path} does not exist; the directory holds {have or 'no layer*.sae.pt'}")
        else:
            m = _LAYER_RE.search(path.name)
            layer = None if layer is None else _check_int_layer(layer)
            if layer is None and m is None:
                raise TypeError(f"cannot tell the layer of {path.name}; pass layer= explicitly")
            if layer is not None and m is not None and int(m[1]) != layer:
                raise ValueError(f"asked for layer {layer} but the file is {path.name} (layer {m[1]})")
            layer = int(m[1]) if layer is None else layer
    elif isinstance(source, str) and source.count("/") <= 1 and not source.startswith((".", "/", "~")):
        release = get_release(source)
        if layer is None:
            raise TypeError(f"load({source!r}, layer): a release needs a layer index, one of {release.layers}")
        layer = release.check_layer(layer)
        path = _hub_file(release, layer, revision, cache_dir)
    else:
        raise FileNotFoundError(f"{source!r} is neither an existing file/directory nor a release or repo id; "
                                f"known releases: {', '.join(r.id for r in list_releases())}")
    saved = _saved_config(path.parent) if path is not None and path.is_file() else None
    if saved is not None:
        # A set written by save_release says its own sizes; the directory name then only counts when it agrees.
        if release is not None and (release.k != saved["k"] or release.d_sae not in (None, saved["d_sae"])
                                    or release.d_model not in (None, saved["d_model"])):
            release = None
        if k is not None and k != saved["k"]:
            raise ValueError(f"k={k} contradicts {path.parent / RELEASE_CONFIG}, which says k={saved['k']}; drop k=")
        k = saved["k"]
    if release is not None and k is not None and k != release.k:
        raise ValueError(f"k={k} contradicts {release.repo_id}, whose name says k={release.k} (L0_{release.k}); "
                         f"drop k= or rename the directory")
    k = release.k if release is not None else k
    if k is None:
        raise ValueError(f"cannot tell k for {path}: its directory is not named like 'SAE-Res-<model>-W<N>K-L0_<k>'; "
                         f"pass k= to load()")
    return path, release, layer, k


RELEASE_CONFIG = "release.json"


def _saved_config(directory: Path) -> dict | None:
    """The sizes ``save_release`` wrote beside its files (``release.json``), or None."""
    import json

    file = directory / RELEASE_CONFIG
    if not file.is_file():
        return None
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
        return {key: int(data[key]) for key in ("k", "d_sae", "d_model")}
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SAEFileError(f"{file} is not a readable release config ({e}); expected JSON with integer k, d_sae and "
                           f"d_model as save_release writes it — fix or delete it") from None


def _check_int_layer(layer) -> int:
    try:
        index = layer_index(layer)
    except TypeError:
        index = -1
    if index < 0:
        raise ValueError(f"layer must be a non-negative int (or a sae-lens SAE id like 'layer12'), got {layer!r}")
    return index


# ---------------------------------------------------------------------------------------------------- reading
def read_release_file(path: str | Path, release: Release | None = None) -> dict[str, torch.Tensor]:
    """Read and validate one SAE file (``.pt`` via ``weights_only=True``, or ``.safetensors``) onto the CPU.

    Args:
        path: the file.
        release: if given, d_model / d_sae must match it.
    Returns:
        dict with exactly ``W_enc [d_sae, d_model], W_dec [d_model, d_sae], b_enc [d_sae], b_dec [d_model]``.
    Raises:
        SAEFileError: refused pickle, truncated/corrupt file, missing keys, wrong shapes or sizes.
    """
    path = Path(path)
    if path.is_dir():
        raise SAEFileError(f"{path} is a directory, expected an SAE file (layer{{n}}.sae.pt or .safetensors)")
    if path.suffix == ".safetensors":
        state = _read_safetensors(path)
    else:
        state = _torch_load(path)
    if not isinstance(state, dict):
        raise SAEFileError(f"{path} holds a {type(state).__name__}, expected a dict of tensors {list(RELEASE_KEYS)}")
    missing = [key for key in RELEASE_KEYS if key not in state]
    if missing:
        raise SAEFileError(f"{path} lacks key(s) {missing}; it has {sorted(map(str, state))}, a Qwen-Scope SAE "
                           f"file has {list(RELEASE_KEYS)}")
    extra = sorted(str(key) for key in state if key not in RELEASE_KEYS)
    if extra:
        warnings.warn(f"{path}: ignoring unexpected keys {extra}", stacklevel=3)
    state = {key: state[key] for key in RELEASE_KEYS}
    try:
        d_model, d_sae = _check_release_shapes(state, str(path))
    except (ValueError, TypeError) as e:
        raise SAEFileError(str(e)) from None
    if d_model < 1 or d_sae < 1:
        raise SAEFileError(f"{path} has W_enc of shape {tuple(state['W_enc'].shape)}: an SAE needs d_sae >= 1 and "
                           f"d_model >= 1; the file is damaged — delete it and download it again")
    _check_finite(state, path)
    if release is not None:
        for name, want, got in (("d_model", release.d_model, d_model), ("d_sae", release.d_sae, d_sae)):
            if want is not None and want != got:
                raise SAEFileError(f"{path} has {name}={got} but {release.repo_id} has {name}={want}; "
                                   f"the file belongs to another release (or is damaged) — delete it and re-download")
    return state


def _check_finite(state: dict[str, torch.Tensor], path: Path) -> None:
    """NaN / Inf weights would turn every code into NaN downstream without an error: refuse them here."""
    for key, t in state.items():
        finite = torch.isfinite(t)
        if not bool(finite.all()):
            bad = int((~finite).sum())
            raise SAEFileError(f"{path}: {key} has {bad} non-finite value(s) (NaN or Inf) of {t.numel()}; expected "
                               f"finite weights. The file is damaged or was saved from a diverged run — download it "
                               f"again or retrain")


_WEIGHTS_ONLY_ADVICE = ("Weights only load failed", "In PyTorch 2.6", "Re-running `torch.load`", "Check the documentation",
                        "Please file an issue", "WeightsUnpickler error")


def _detail(e: BaseException) -> str:
    """The informative line of a torch.load error (weights_only errors bury it under advice)."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    for ln in lines:
        if "WeightsUnpickler error:" in ln and ln.split("WeightsUnpickler error:", 1)[1].strip():
            return ln.split("WeightsUnpickler error:", 1)[1].strip()
    useful = [ln for ln in lines if not ln.startswith(_WEIGHTS_ONLY_ADVICE)]
    if useful:
        return useful[0][:200]
    return f"{type(e).__name__}: {lines[0][:200]}" if lines else f"{type(e).__name__}, empty or cut short"


def _refused(detail: str) -> bool:
    """Whether weights_only refused the file for what it holds (a global / class: code), not for damage."""
    text = detail.lower()
    return "global" in text or "unsupported class" in text or "not an allowed" in text


def _torch_load(path: Path):
    try:
        try:
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as e:
            if "mmap can only be used" not in str(e):
                raise
            # Legacy (non-zip) serialization cannot be memory-mapped; read it normally.
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        detail = _detail(e)
        if _refused(detail):
            raise SAEFileError(
                f"refused to load {path}: it holds code or objects beyond a dict of tensors ({detail}), which "
                f"weights_only=True never runs. Qwen-Scope files never need that; load it with weights_only=False "
                f"only if you trust its origin and know what it runs") from None
        raise SAEFileError(f"could not read {path} ({detail}); the file is truncated or not a torch file — "
                           f"delete it and download it again") from None
    except MemoryError:
        raise SAEFileError(f"could not read {path}: it declares more data than fits in memory; the file is damaged "
                           f"or not an SAE file — delete it and download it again") from None
    except Exception as e:
        # torch's readers of a damaged zip or pickle raise all kinds (RuntimeError, EOFError, IndexError, KeyError,
        # AssertionError, OverflowError ...): every one is the same answer for an SAE file.
        raise SAEFileError(f"could not read {path} ({_detail(e)}); the file is truncated or not a torch file — "
                           f"delete it and download it again") from None


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(path, device="cpu")
    except (SafetensorError, OSError, ValueError, RuntimeError, TypeError, KeyError, OverflowError) as e:
        raise SAEFileError(f"could not read {path} ({e}); the file is truncated or corrupt — delete it") from None


# ---------------------------------------------------------------------------------------------------- conversion cache
def _cache_path(root: Path, path: Path, release: Release | None, layer: int, dtype: torch.dtype) -> Path:
    real = path.resolve()
    st = real.stat()
    # A replaced or rewritten file changes its inode or ctime even when its size and mtime are kept (ctime cannot be
    # set back); the first and last MiB catch a copy that kept all three.
    with real.open("rb") as f:
        head = f.read(1 << 20)
        f.seek(max(st.st_size - (1 << 20), 0))
        tail = f.read(1 << 20)
    digest = hashlib.sha1(f"{real}|{st.st_size}|{st.st_mtime_ns}|{st.st_ctime_ns}|{st.st_ino}".encode())
    digest.update(head)
    digest.update(tail)
    name = release.id if release is not None else path.parent.name
    return root / f"{name}--layer{layer}--{str(dtype).removeprefix('torch.')}--{digest.hexdigest()[:16]}.safetensors"


def _via_cache(root: str | Path, path: Path, release: Release | None, layer: int, k: int,
               dtype: torch.dtype) -> dict[str, torch.Tensor]:
    from safetensors.torch import save_file

    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"the safetensors cache stores float32, bfloat16 or float16, not {dtype}")
    root = Path(root).expanduser()
    target = _cache_path(root, path, release, layer, dtype)
    if not target.exists():
        state = read_release_file(path, release)
        root.mkdir(parents=True, exist_ok=True)
        # One temporary per writer (process, thread, call): concurrent loads of one layer each write their own and
        # the last rename wins with identical bytes.
        tmp = target.with_name(f".{target.name}.{os.getpid()}-{threading.get_ident()}-{uuid.uuid4().hex[:8]}.tmp")
        meta = {"source": str(path), "layer": str(layer), "k": str(k), "release": release.id if release else ""}
        try:
            save_file({key: t.to(dtype).contiguous() for key, t in state.items()}, tmp, metadata=meta)
            os.replace(tmp, target)
            logger.info("converted %s to %s", path, target)
        finally:
            tmp.unlink(missing_ok=True)  # a failed write (disk full, interrupt) leaves no stray temporary
    return read_release_file(target, release)


# ---------------------------------------------------------------------------------------------------- public
def load(source: str | Path, layer: int | None = None, *, device: str | torch.device | None = None,
         dtype: torch.dtype | None = None, revision: str | None = None, cache_dir: str | Path | None = None,
         k: int | None = None, expected_d_model: int | None = None,
         safetensors_cache: str | Path | None = None) -> TopKSAE:
    """Load one Qwen-Scope SAE as a ``TopKSAE`` (eval mode, no gradients).

    Args:
        source: sae-lens release id (``"qwen-scope-3.5-2b-base-w32k-l100"``), HF repo id
            (``"Qwen/SAE-Res-Qwen3.5-2B-Base-W32K-L0_100"``), a local release directory, or a single
            ``.pt`` / ``.safetensors`` file.
        layer: layer index (0-based; optional for a file named ``layer{n}...``), or sae-lens's SAE id ``"layer12"``.
        device: where the weights go (default CPU).
        dtype: weight dtype (default: as stored, float32).
        revision, cache_dir: hub revision and cache (``HF_HUB_CACHE`` and ``HF_HUB_OFFLINE`` are honoured).
        k: only for sources whose name does not carry ``L0_<k>``.
        expected_d_model: the model's hidden size; a mismatch raises (see ``check_d_model``).
        safetensors_cache: directory for a one-time safetensors copy in ``dtype`` (bf16/fp16/fp32); later loads
            memory-map it instead of unpickling the ``.pt``.
    Returns:
        ``TopKSAE`` with ``.release``, ``.layer`` and ``.source`` set.

    Example:
        >>> sae = load("qwen-scope-3.5-2b-base-w32k-l100", 12, device="cuda", dtype=torch.bfloat16)
    """
    if dtype is not None and not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating-point torch dtype, got {dtype}")
    path, release, layer, k = resolve(source, layer, revision=revision, cache_dir=cache_dir, k=k)
    if safetensors_cache is not None:
        state = _via_cache(safetensors_cache, path, release, layer, k, dtype or torch.float32)
    else:
        state = read_release_file(path, release)
    if not 1 <= k <= state["W_enc"].shape[0]:
        raise SAEFileError(f"{path} has d_sae={state['W_enc'].shape[0]} but k={k} (from the release name or k=); "
                           f"expected 1 <= k <= d_sae — is it the right file for this release?")
    state = {key: t.to(device=device, dtype=dtype) for key, t in state.items()}
    sae = TopKSAE.from_release_state(state, k=k).requires_grad_(False).eval()
    sae.release, sae.layer, sae.source = release, layer, str(path)
    logger.debug("loaded layer %d SAE (d_model %d, d_sae %d, k %d) from %s", layer, sae.d_model, sae.d_sae, k, path)
    if expected_d_model is not None:
        check_d_model(sae, expected_d_model)
    return sae


def check_d_model(sae: TopKSAE, model_d_model: int, source: str | None = None) -> None:
    """Raise ``ValueError`` unless the SAE reads a residual stream of size ``model_d_model``.

    Args:
        sae: a loaded SAE (its ``.release``/``.layer``/``.source`` name it in the message).
        model_d_model: hidden size of the model it will be attached to.
        source: name of that model, for the message (e.g. ``"Qwen/Qwen3-8B"``).
    """
    if sae.d_model == model_d_model:
        return
    rel = sae.release.id if sae.release is not None else (sae.source or "SAE")
    fits = [r.id for r in list_releases() if r.d_model == model_d_model]
    model = f"model {source}" if source else "the model"
    raise ValueError(f"{rel} layer {sae.layer} expects d_model {sae.d_model}, but {model} has hidden size "
                     f"{model_d_model}; use an SAE set for this model ({', '.join(fits) or 'none of the 14 fits'})")


__all__ = ["RELEASE_CONFIG", "SAEFileError", "check_d_model", "hub_unreachable", "load", "read_release_file", "resolve"]
