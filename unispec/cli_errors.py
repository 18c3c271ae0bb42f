"""How the CLI fails: one clear line, never a traceback unless `--debug` (STYLE.md rule 10)."""

from __future__ import annotations

from pathlib import Path

import click

from runtime.errors import UnispecError

__all__ = ["OneLineErrors", "one_line", "read_text"]


class OneLineErrors(click.Group):
    """Turns unispec's own errors into one clear line (exit 1) unless `--debug` asks for the traceback; an OS
    failure (disk full, `ulimit -f`, a symlink loop, no permission, ...), raised or wrapped by a library, is
    the line naming its path and what to change; anything else that escapes (a bug, or a failure nobody
    anticipated) is one line too."""

    def invoke(self, ctx: click.Context):  # type: ignore[override]
        try:
            return super().invoke(ctx)
        except (click.ClickException, click.exceptions.Exit, click.exceptions.Abort):
            raise
        except Exception as exc:
            if ctx.obj and ctx.obj.get("debug"):
                raise
            raise click.ClickException(one_line(exc)) from None


# modules of the optional extras (pyproject.toml) -> the extra that installs them; the core install lacks them
EXTRAS = {"torch": "export", "onnxscript": "export", "onnx_ir": "export", "transformers": "export",
          "safetensors": "export", "huggingface_hub": "export", "xgrammar": "structured", "fastapi": "serve",
          "uvicorn": "serve", "onnxruntime_genai": "bench", "matplotlib": "bench"}


def one_line(exc: Exception) -> str:
    """The CLI's line for an exception that ended a command (click's own errors aside)."""
    if isinstance(exc, UnispecError):
        return str(exc)
    if isinstance(exc, ModuleNotFoundError) and (exc.name or "").split(".")[0] in EXTRAS:
        extra = EXTRAS[exc.name.split(".")[0]]
        return f"this command needs {exc.name}, which comes with unispec's `{extra}` extra: pip install -e '.[{extra}]'"
    if isinstance(exc, MemoryError):
        return ("out of memory (a MemoryError in this process); free memory or use a machine with more, and for "
                "`export` a weight-only --quantize int4 / int8 or a smaller --max-batch-size / --max-model-len")
    from export.out_dir import explain_os_error, os_error_in

    cause = os_error_in(exc)
    if cause is not None:
        return f"cannot read or write a file: {explain_os_error(cause)}"
    reason = " ".join(str(exc).split())[:300] or "no message"
    return f"unexpected {type(exc).__name__}: {reason}; rerun with --debug for the traceback and please report it"


def read_text(path: Path, flag: str) -> str:
    """A UTF-8 text file an option names; a one-line error when it is not one."""
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UnispecError(f"{flag} {path} is not UTF-8 text (byte {exc.start} is not); save it as UTF-8") from None
    except OSError as exc:
        raise UnispecError(f"{flag} {path}: cannot read it ({exc.strerror})") from None
