"""The Qwen-Scope release catalogue: the 14 SAE sets as data (``releases.csv``) plus a parser for repo ids.

Release ids are sae-lens' (``qwen-scope-3.5-2b-base-w32k-l100``); repos are ``Qwen/SAE-Res-{model}-W{N}K-L0_{k}``
holding ``layer{n}.sae.pt`` for n in [0, n_layers). k always comes from the name, d_sae = N * 1024.
"""
from __future__ import annotations

import csv
import difflib
import operator
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

_CSV = Path(__file__).with_name("releases.csv")
# A checkpoint name that says which Qwen model it is (instruct checkpoints carry no suffix): "qwen3.5-2b", "qwen3-8b".
_QWEN_NAME = re.compile(r"qwen\d[\w.-]*")
_REPO_RE = re.compile(r"^(?:(?P<org>[\w.-]+)/)?SAE-Res-(?P<model>[\w.-]+?)-W(?P<width>\d+)K-L0_(?P<k>\d+)$",
                      re.IGNORECASE)


@dataclass(frozen=True)
class Release:
    """One Qwen-Scope SAE set (one HF repo): a residual-stream TopK SAE for every layer of one model.

    Attributes:
        id: sae-lens release id, e.g. ``"qwen-scope-3.5-2b-base-w32k-l100"``.
        repo_id: Hugging Face repo, e.g. ``"Qwen/SAE-Res-Qwen3.5-2B-Base-W32K-L0_100"``.
        model_id: the checkpoint the SAEs were trained on, e.g. ``"Qwen/Qwen3.5-2B-Base"``.
        trained_on: ``"base"`` or ``"instruct"``.
        d_model, d_sae, k, n_layers: sizes; ``d_model``/``n_layers`` are ``None`` for a parsed, unregistered repo
            of an unknown model, ``d_sae`` is ``None`` when the name says ``W0K``.
        registered: whether the set is one of the 14 published ones (False = parsed from a repo id).
    """

    id: str
    repo_id: str
    model_id: str
    trained_on: str
    d_model: int | None
    d_sae: int | None
    k: int
    n_layers: int | None
    registered: bool = True

    @property
    def expansion(self) -> int | None:
        """d_sae / d_model (16 or 64 for the published sets)."""
        return self.d_sae // self.d_model if self.d_sae and self.d_model else None

    @property
    def file_bytes(self) -> int | None:
        """Size of one ``layer{n}.sae.pt`` payload in fp32: 4 * (2 d_model d_sae + d_sae + d_model)."""
        if not (self.d_sae and self.d_model):
            return None
        return 4 * (2 * self.d_model * self.d_sae + self.d_sae + self.d_model)

    @property
    def total_bytes(self) -> int | None:
        """Size of the whole repo's SAE files (n_layers * file_bytes)."""
        return self.file_bytes * self.n_layers if self.file_bytes and self.n_layers else None

    @property
    def layers(self) -> range | None:
        return range(self.n_layers) if self.n_layers else None

    @staticmethod
    def filename(layer: int) -> str:
        """File of ``layer`` inside the repo: ``layer{n}.sae.pt``."""
        return f"layer{int(layer)}.sae.pt"

    def model_mismatch(self, model_id: str) -> str | None:
        """Why applying this set to ``model_id`` deserves a warning, or ``None``.

        ``None`` for the training model (hub id or a directory of that name), and for a name that says nothing about
        the checkpoint (a local directory such as ``/tmp/run-3``: no claim either way). Base-trained SAEs on the
        matching instruct model (or the reverse) are reasonable, the model card says, but shifted; any other Qwen
        model is a different residual stream.

        Example:
            >>> rel = get_release("qwen-scope-3.5-2b-base-w32k-l100")
            >>> rel.model_mismatch("Qwen/Qwen3.5-2B-Base") is None, rel.model_mismatch("/tmp/run-3") is None
            (True, True)
            >>> rel.model_mismatch("Qwen/Qwen3.5-2B")   # "... is its post-trained sibling (the instruct model): ..."
        """
        (theirs, their_base), (ours, our_base) = _checkpoint(model_id), _checkpoint(self.model_id)
        if (theirs, their_base) == (ours, our_base) or not (their_base or _QWEN_NAME.fullmatch(theirs)):
            return None
        if theirs == ours:
            sibling = "base sibling" if their_base else "post-trained sibling (the instruct model)"
            return (f"{self.id} was trained on the {self.trained_on} model {self.model_id}; {model_id} is its "
                    f"{sibling}: the model card says features transfer reasonably, but activations shift (expect "
                    f"somewhat lower reconstruction quality: check the explained variance)")
        return f"{self.id} was trained on {self.model_id}, not {model_id}: its features may not apply"

    def check_layer(self, layer: int) -> int:
        """Return ``layer`` (an int or a sae-lens SAE id like ``"layer12"``) as int or raise ``ValueError`` naming
        the valid range."""
        layer = layer_index(layer)
        if layer < 0 or (self.n_layers is not None and layer >= self.n_layers):
            valid = f"0..{self.n_layers - 1}" if self.n_layers else ">= 0"
            raise ValueError(f"{self.id} has no layer {layer}; valid layers are {valid} "
                             f"({self.n_layers or 'unknown number of'} layers of {self.model_id})")
        return layer


_SAE_ID = re.compile(r"^(?:layer[_.]?)?(\d+)$", re.IGNORECASE)


def layer_index(layer: int | str) -> int:
    """A layer given as an int or as sae-lens's SAE id (``"layer12"``; ``"12"`` too) -> ``12``.

    Raises:
        TypeError: neither an int nor such a string.

    Example:
        >>> layer_index("layer12"), layer_index(12)
        (12, 12)
    """
    if isinstance(layer, str):
        m = _SAE_ID.match(layer.strip())
        if m is None:
            raise TypeError(f"layer must be an int or a sae-lens SAE id like 'layer12', got {layer!r}")
        return int(m[1])
    try:
        # operator.index: ints and numpy integers, never a float or a bool's silent 0 / 1.
        if not isinstance(layer, bool):
            return operator.index(layer)
    except TypeError:
        pass
    raise TypeError(f"layer must be an int or a sae-lens SAE id like 'layer12', got {type(layer).__name__} {layer!r}")


def _checkpoint(name: str) -> tuple[str, bool]:
    """``"Qwen/Qwen3.5-2B-Base"`` -> ``("qwen3.5-2b", True)``: the checkpoint's last path part, lower case, without
    ``-base``, and whether it had it."""
    tail = name.strip().rstrip("/").split("/")[-1].lower()
    return (tail[:-5], True) if tail.endswith("-base") else (tail, False)


@lru_cache(maxsize=1)
def _table() -> tuple[Release, ...]:
    with _CSV.open(newline="") as f:
        rows = list(csv.DictReader(f))
    ints = ("n_layers", "d_model", "d_sae", "k")
    return tuple(Release(**{key: int(v) if key in ints else v for key, v in row.items()}) for row in rows)


def list_releases(model: str | None = None, trained_on: str | None = None) -> list[Release]:
    """The 14 published sets, in table order, optionally filtered.

    Args:
        model: keep sets whose ``model_id`` contains this (case-insensitive), e.g. ``"Qwen3.5-2B"``.
        trained_on: ``"base"`` or ``"instruct"``.
    Returns:
        list of ``Release``.
    """
    out = list(_table())
    if model:
        out = [r for r in out if model.lower() in r.model_id.lower()]
    if trained_on:
        out = [r for r in out if r.trained_on == trained_on]
    return out


def parse_repo_id(repo_id: str) -> Release:
    """Parse any ``[org/]SAE-Res-{model}-W{N}K-L0_{k}`` name into a ``Release`` (k and width from the name).

    Sizes known from the registry for the same model (d_model, n_layers) are filled in; otherwise ``None``.

    Raises:
        ValueError: the name does not follow the pattern.
    """
    m = _REPO_RE.match(repo_id.strip())
    if m is None:
        raise ValueError(f"could not parse {repo_id!r} as a Qwen-Scope repo id; expected "
                         f"'Qwen/SAE-Res-<model>-W<N>K-L0_<k>', e.g. 'Qwen/SAE-Res-Qwen3.5-2B-Base-W32K-L0_100'")
    org, model, width, k = m["org"] or "Qwen", m["model"], int(m["width"]), int(m["k"])
    model_id = f"Qwen/{model}" if org == "Qwen" else f"{org}/{model}"
    known = [r for r in _table() if r.model_id.lower() == f"qwen/{model}".lower()]
    short = model.lower()[4:] if model.lower().startswith("qwen") else model.lower()
    return Release(
        id=f"qwen-scope-{short}-w{width}k-l{k}", repo_id=f"{org}/SAE-Res-{model}-W{width}K-L0_{k}",
        model_id=model_id, trained_on="base" if model.lower().endswith("-base") else "instruct",
        d_model=known[0].d_model if known else None, d_sae=width * 1024 or None, k=k,
        n_layers=known[0].n_layers if known else None, registered=False)


_ID_RE = re.compile(r"^qwen-scope-(?P<short>[\w.-]+?)-w(?P<width>\d+)k-l(?P<k>\d+)$")


def _release_from_derived_id(key: str) -> Release | None:
    """The release behind an id that ``parse_repo_id`` derived for an unregistered set (``qwen-scope-3.5-nano-base-
    w1k-l16`` -> ``Qwen/SAE-Res-Qwen3.5-Nano-Base-W1K-L0_16``; hub names are case-insensitive). None for a registered
    model's name: a width or k the table lacks there is a typo, answered with the closest ids."""
    m = _ID_RE.match(key)
    if m is None or any(r.model_id.lower() == f"qwen/qwen{m['short']}" for r in _table()):
        return None
    words = [w.upper() if re.fullmatch(r"a?\d+(\.\d+)?b", w) else w.capitalize() for w in m["short"].split("-")]
    return parse_repo_id(f"Qwen/SAE-Res-Qwen{'-'.join(words)}-W{m['width']}K-L0_{m['k']}")


def get_release(id_or_repo: str) -> Release:
    """Look up a set by sae-lens release id or HF repo id (with or without ``Qwen/``), case-insensitively.

    Unregistered names of the ``SAE-Res-...-W<N>K-L0_<k>`` pattern are parsed (``registered=False``), and so are the
    ids derived from them (``Release.id`` of such a set) when the model is not one of the registered ones.

    Raises:
        ValueError: unknown id, with the closest known ids.
    """
    if not isinstance(id_or_repo, str):
        raise TypeError(f"expected a release id or repo id string, got {type(id_or_repo).__name__}")
    key = id_or_repo.strip().lower()
    for r in _table():
        if key in (r.id, r.repo_id.lower(), r.repo_id.split("/")[1].lower()):
            return r
    try:
        return parse_repo_id(id_or_repo)
    except ValueError:
        pass
    derived = _release_from_derived_id(key)
    if derived is not None:
        return derived
    names = [r.id for r in _table()] + [r.repo_id for r in _table()]
    close = difflib.get_close_matches(id_or_repo, names, n=3, cutoff=0.5)
    hint = f" Did you mean {', '.join(close)}?" if close else ""
    raise ValueError(f"unknown Qwen-Scope release {id_or_repo!r}.{hint} Known ids: "
                     f"{', '.join(r.id for r in _table())} (see `qwen-scope releases`).")
