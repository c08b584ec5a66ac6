"""Checkpoint names: a local directory, or a Hugging Face Hub repo id resolved through the local cache.

:func:`resolve_checkpoint` turns what a user typed (``ember.load(x)``, ``ember generate x``,
``ember quantize x OUT``) into a directory: an existing directory wins; otherwise ``org/name`` is a
Hub repo id, fetched with ``huggingface_hub.snapshot_download`` (only the files ember reads: config,
safetensors weights and index, tokenizer and generation files, chat template) into the standard
cache (``HF_HOME`` / ``HF_HUB_CACHE``), or found there with ``HF_HUB_OFFLINE=1``. huggingface_hub
reads those variables itself.

Example:
    >>> resolve_checkpoint("Qwen/Qwen3-30B-A3B", revision="main")
    PosixPath('/root/.cache/huggingface/hub/models--Qwen--Qwen3-30B-A3B/snapshots/<commit>')
"""
from __future__ import annotations

import os
import re
from pathlib import Path

# The files ember reads from a checkpoint (never pickles, never the original/ or onnx/ folders).
ALLOW_PATTERNS = ["config.json", "*.safetensors", "model.safetensors.index.json", "generation_config.json",
                  "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                  "chat_template.json", "vocab.json", "merges.txt"]
# org/name: letters, digits, '-', '_', '.'; no leading/trailing '-'/'.'; no '--' or '..' (the Hub's rule).
_PART = r"[A-Za-z0-9](?:[\w.-]{0,94}[A-Za-z0-9])?"
_REPO_ID = re.compile(rf"{_PART}/{_PART}")


class CheckpointNotFound(FileNotFoundError):
    """A name that is neither a checkpoint directory nor a Hub repo ember could fetch or find cached."""


def is_repo_id(name: str) -> bool:
    """Whether ``name`` has the shape of a Hub model repo id (``org/name``)."""
    return bool(_REPO_ID.fullmatch(name)) and "--" not in name and ".." not in name


def resolve_checkpoint(name_or_path, revision: str | None = None) -> Path:
    """The checkpoint directory for a local path or a Hub repo id (``org/name``).

    A path that exists wins over a repo id of the same spelling. ``revision`` (a branch, tag or
    commit) applies to repo ids only. Errors are :class:`CheckpointNotFound` (a ``FileNotFoundError``)
    with one line saying what was tried and how to fix it.
    """
    if revision is not None and (not isinstance(revision, str) or not revision):
        raise ValueError(f"revision: expected a branch, tag or commit string, got {revision!r}")
    text = os.fspath(name_or_path)
    path = Path(text).expanduser()
    if path.is_dir():
        if revision is not None:
            raise ValueError(f"revision: applies to Hugging Face repo ids, but {text!r} is a local directory")
        return path
    if path.exists():
        raise CheckpointNotFound(f"{text!r}: not a directory (expected a checkpoint directory or a "
                                 "Hugging Face repo id org/name)")
    if not isinstance(name_or_path, str) or not is_repo_id(text):
        raise CheckpointNotFound(f"{text!r}: not a directory and not a Hugging Face repo id (org/name)")
    return Path(_download(text, revision))


def _download(repo_id: str, revision: str | None) -> str:
    try:
        import huggingface_hub
        from huggingface_hub import constants, errors
    except ModuleNotFoundError:
        raise CheckpointNotFound(f"{repo_id!r}: not a local directory, and huggingface_hub is not installed to "
                                 "fetch it from the Hub (pip install huggingface_hub)") from None
    rev = revision or "main"
    where = f"{repo_id} (revision {rev})"
    cache = constants.HF_HUB_CACHE
    try:
        # offline: straight to the cache (a commit-hash revision would otherwise ask the Hub for its file list)
        return huggingface_hub.snapshot_download(repo_id, revision=revision, allow_patterns=ALLOW_PATTERNS,
                                                 local_files_only=bool(constants.HF_HUB_OFFLINE))
    except errors.RevisionNotFoundError:
        raise CheckpointNotFound(f"{where}: the repo has no revision {rev!r} on the Hub") from None
    except (errors.GatedRepoError, errors.RepositoryNotFoundError):
        raise CheckpointNotFound(f"{where}: no such model repo on the Hugging Face Hub, or it is private / gated "
                                 "(log in with `huggingface-cli login` and accept its terms)") from None
    except getattr(errors, "IncompleteSnapshotError", ()) as e:  # huggingface_hub >= 1.3x
        raise CheckpointNotFound(f"{where}: the cached copy in {cache} is incomplete ({_first_line(e)}); "
                                 f"finish it with `huggingface-cli download {repo_id}` while online") from None
    except errors.LocalEntryNotFoundError:
        if constants.HF_HUB_OFFLINE:
            raise CheckpointNotFound(
                f"{where}: not in the Hugging Face cache {cache} and HF_HUB_OFFLINE=1 forbids downloading; "
                f"download it with `huggingface-cli download {repo_id}` while online (or pass a local "
                "directory)") from None
        raise CheckpointNotFound(
            f"{where}: the Hub could not be reached and it is not in the Hugging Face cache {cache}; "
            f"download it with `huggingface-cli download {repo_id}` where there is network, then set "
            "HF_HUB_OFFLINE=1 to use the cache") from None
    except Exception as e:  # HTTP errors from the Hub, proxy errors, a full disk: one line, what and where
        raise CheckpointNotFound(f"{where}: could not fetch it from the Hub ({_first_line(e)}); the cache is "
                                 f"{cache}; set HF_HUB_OFFLINE=1 to use a cached copy") from None


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__


__all__ = ["resolve_checkpoint", "is_repo_id", "CheckpointNotFound", "ALLOW_PATTERNS"]
