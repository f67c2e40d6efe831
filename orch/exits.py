"""How an `orch` command ends: exit codes, short messages, and where tracebacks go.

Exit codes: 0 success; 1 the plan does not fit (`orch check`), training failed, or an internal
error; 2 invalid input (a config Hydra cannot compose, malformed YAML, a value or plan the
orchestrator refuses). A user error prints a few lines naming the key; an unexpected exception
prints one line and the path of a log file holding its traceback. ``--verbose`` (or Hydra's own
``HYDRA_FULL_ERROR=1``) prints the traceback instead.

Hydra's ``hydra.main`` catches every exception of composition and of the task itself
(``hydra._internal.utils.run_and_report``), prints it and exits 1. With ``HYDRA_FULL_ERROR`` set
it re-raises instead, which is how :func:`run_command` gets the exception to classify.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException
from yaml import YAMLError

from orch.credentials import redact_text
from orch.plans.errors import OrchError, first_line

EXIT_FAILED = 1
EXIT_USAGE = 2
# What a shell reports for a command ended by SIGPIPE.
EXIT_BROKEN_PIPE = 128 + 13
# What Hydra and OmegaConf raise for a config the user wrote: unknown keys or options, values of
# the wrong type, malformed YAML in a --config-dir.
CONFIG_ERRORS = (HydraException, OmegaConfBaseException, YAMLError)
# Lines of a short error message at most (the rest is in the traceback).
MAX_MESSAGE_LINES = 4
LOG_DIR_NAME = "orch-errors"
"""Where tracebacks of unexpected errors are written, in the temporary directory of the moment
(``TMPDIR`` as the command sees it, not as it was when this module was imported)."""


class Reported(OrchError):
    """``error``, already shown to the user where it happened (a sweep's job, as it failed): it
    ends the command with its exit code without being shown again when Hydra re-raises it after
    the sweep."""

    def __init__(self, error: OrchError):
        super().__init__(str(error))
        self.error = error

    def __reduce__(self):
        return (type(self), (self.error,))


def exit_code(error: OrchError) -> int:
    """1 for a failure inside training (not the user's input, as a crashed script), 2 for the rest."""
    from orch.launchers.worker_group import WorkerDiedError, WorkerFailedError, WorkerHangError

    if isinstance(error, Reported):
        return exit_code(error.error)
    return EXIT_FAILED if isinstance(error, (WorkerFailedError, WorkerHangError, WorkerDiedError)) else EXIT_USAGE


def run_command(app: Callable[[], None], command: str, *, verbose: bool, json_errors: bool = False) -> int:
    """Run a Hydra app and turn whatever it raises into a message and an exit code; with
    ``json_errors`` (``--json``), the message also goes to stdout as a JSON document
    (:func:`print_json_error`), where the command's result would have been."""
    verbose = verbose or os.environ.get("HYDRA_FULL_ERROR") == "1"
    previous = os.environ.get("HYDRA_FULL_ERROR")
    os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        app()
        return 0
    except BrokenPipeError:
        # The reader of stdout went away (``orch check | head``): nothing more can be shown. Point
        # stdout at /dev/null so the interpreter's final flush does not raise again (the recipe in
        # Python's documentation of SIGPIPE), and end as a shell reports a command ended by SIGPIPE.
        stdout_to_devnull()
        return EXIT_BROKEN_PIPE
    except Reported as error:
        if json_errors:
            print_json_error(error.error, str(error), exit_code(error))
        return exit_code(error)
    except OrchError as error:
        code = _report(error, f"error: {error}", exit_code(error), verbose)
        if json_errors:
            print_json_error(error, str(error), code)
        return code
    except CONFIG_ERRORS as error:
        code = _report(error, f"error: {config_message(error)}", EXIT_USAGE, verbose)
        if json_errors:
            print_json_error(error, config_message(error), code)
        return code
    except Exception as error:  # an internal failure: one line here, the traceback in a file
        message = f"{type(error).__name__}: {first_line(error) or '(no message)'}"
        if json_errors:
            print_json_error(error, f"orch {command} failed: {message}", EXIT_FAILED)
        if verbose:
            return _report(error, f"error: {message}", EXIT_FAILED, verbose)
        log = write_traceback(error, command)
        print(redact_text(f"error: orch {command} failed: {message}\n"
                     f"  traceback in {log} (or run with --verbose)"), file=sys.stderr)
        return EXIT_FAILED
    finally:
        if previous is None:
            os.environ.pop("HYDRA_FULL_ERROR", None)
        else:
            os.environ["HYDRA_FULL_ERROR"] = previous


def stdout_to_devnull() -> None:
    """Point stdout at /dev/null once its reader is gone, so the interpreter's final flush does not
    raise BrokenPipeError again (the recipe in Python's documentation of SIGPIPE)."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def print_json_error(error: BaseException, message: str, code: int) -> None:
    """``{"error": {"message", "exit_code", "violations"}}`` on stdout, credentials redacted: a
    program reading ``--json`` output gets a document for a refusal too, each problem a field."""
    from orch.plans.errors import PlanError

    document = {"message": message, "exit_code": code}
    if isinstance(error, PlanError):
        document["violations"] = [v.as_dict() for v in error.violations]
    print(redact_text(json.dumps({"error": document}, indent=2)), flush=True)


def _report(error: BaseException, message: str, code: int, verbose: bool) -> int:
    if verbose:
        print(redact_text("".join(traceback.format_exception(error))), file=sys.stderr)
    print(redact_text(message), file=sys.stderr)
    return code


def config_message(error: BaseException) -> str:
    """Hydra's or YAML's message in a few lines: the key and what is wrong, without the search
    path, the schema's internal type names or option lists spread over lines."""
    text = str(error)
    if isinstance(error.__cause__, OmegaConfBaseException) and str(error.__cause__) not in text:
        text += "\n" + str(error.__cause__)
    if isinstance(error, YAMLError):
        return "malformed YAML: " + "; ".join(line.strip() for line in text.splitlines() if line.strip())
    lines: list[str] = []
    for raw in text.splitlines():
        line = raw.strip()
        if line.startswith("Config search path"):
            break
        if not line or line.startswith(("reference_type=", "object_type=")) or "HYDRA_FULL_ERROR" in line:
            continue
        if raw.startswith("\t") and lines and lines[-1].startswith("Available options"):
            if not line.endswith("_schema"):  # the structured schemas behind the YAML files
                lines[-1] += f" {line},"
            continue
        lines.append(line)
    lines = [line.rstrip(",") for line in lines]
    return "\n  ".join(lines[:MAX_MESSAGE_LINES])


def write_traceback(error: BaseException, command: str) -> Path:
    """The error's traceback in a new file only this user can read, credentials redacted."""
    log_dir = Path(tempfile.gettempdir()) / LOG_DIR_NAME
    log_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = log_dir / f"{command}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as log:
        log.write(f"orch {redact_text(' '.join(sys.argv[1:]))}\n\n")
        log.write(redact_text("".join(traceback.format_exception(error))))
    return path

