"""What every command shares: the consoles, error reporting, the Typer factory, shared options, settings.

Errors Shoal raises on purpose are printed as one red line on stderr with exit status 1; bad usage exits
with 2 (Typer's own convention).

The consoles print strings literally (no rich markup, no :emoji: codes): what they print holds names,
descriptions, attribute values, paths and reasons that may contain "[...]" or ":...:". A message styled on
purpose passes markup=True with its data escaped (rich.markup.escape), or prints a rich Text.

Nor do they let that text drive the terminal: every string and rich Text they print (tables, titles, cells,
messages) shows its control characters (C0 but tab and newline, DEL, C1, bidi overrides) as escapes such as
\\x1b or \\u202e (see `visible`), so a tenant's description or attribute value cannot recolour, erase or spoof
lines, or set the window title. `--json` output is json.dumps', which escapes them itself.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import os
from collections.abc import Callable, Iterator, Mapping
from typing import Annotated, Any, NoReturn, TypeVar

import kombu.exceptions
import pydantic
import redis
import typer
from rich.console import Console, ConsoleOptions, RenderableType
from rich.segment import Segment
from rich.text import Span, Text

from shoal.catalog.repo import tenant_exists
from shoal.client import Shoal
from shoal.config.settings import Settings
from shoal.errors import ConfigurationError, NotFoundError, ShoalError
from shoal.log.records import check_tenant_name
from shoal.runtime import Runtime

F = TypeVar("F", bound=Callable[..., Any])


# What `visible` escapes: C0 but tab and newline, DEL, C1, and the bidi embeddings, overrides and isolates
# (they reorder what follows on the line: "Trojan Source").
_HIDDEN = [*(c for c in range(0x20) if chr(c) not in "\t\n"), *range(0x7F, 0xA0),
           *range(0x202A, 0x202F), *range(0x2066, 0x206A)]
_VISIBLE = str.maketrans({c: f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}" for c in _HIDDEN})


def visible(text: str) -> str:
    """`text` with every control character but tab and newline (C0, DEL, C1) and every bidi override shown
    as a Python-style escape (\\x1b, \\u202e): printed, it cannot move the cursor, restyle or reorder a line."""
    return text.translate(_VISIBLE)


def visible_text(text: Text) -> Text:
    """A copy of the rich Text `text` with `visible` applied to its characters, its styles kept on them."""
    plain = text.plain
    if plain == visible(plain):
        return text
    starts = [0]  # starts[i]: where the i-th character of `plain` starts once escaped (the last: the end)
    for char in plain:
        starts.append(starts[-1] + len(visible(char)))
    last = len(plain)
    shown = text.copy()
    shown.plain = visible(plain)
    shown.spans = [Span(starts[min(s.start, last)], starts[min(s.end, last)], s.style) for s in text.spans]
    return shown


class PlainConsole(Console):
    """A Console whose every str and Text goes through `visible` before it is printed.

    render_str turns every str (printed, a table cell, a title) into Text, for rendering and measuring alike;
    render is where any Text arrives, built by a command or nested in a table, panel or group. A Text cell of
    a table is measured before render sees it: built from visible() text, its column fits what is shown.
    """

    def render_str(self, text: str, **kwargs: Any) -> Text:
        """Console.render_str of `visible(text)`."""
        return super().render_str(visible(text), **kwargs)

    def render(self, renderable: RenderableType, options: ConsoleOptions | None = None) -> Iterator[Segment]:
        """Console.render, a Text first made visible (a str is, by render_str)."""
        if isinstance(renderable, Text):
            renderable = visible_text(renderable)
        yield from super().render(renderable, options)


out = PlainConsole(highlight=False, markup=False, emoji=False)
err = PlainConsole(stderr=True, highlight=False, markup=False, emoji=False)
PIPE_WIDTH = 200  # columns of piped or captured output

Tenant = Annotated[
    str | None, typer.Option("--tenant", help="Tenant to work in (default: SHOAL_TENANT, else 'default').")
]
Name = Annotated[str, typer.Argument(help="Data source name.")]
Version = Annotated[str, typer.Argument(help="Data source version.")]
AsJson = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")]


def fit_consoles() -> None:
    """Keep a terminal's own width; give piped or captured output PIPE_WIDTH columns instead of 80."""
    for console in (out, err):
        console.width = console.width if console.is_terminal or "COLUMNS" in os.environ else PIPE_WIDTH


def fail(message: str) -> NoReturn:
    """Print `message` as one red line on stderr and exit with status 1."""
    err.print(Text("error: " + " ".join(message.split()), style="bold red"), soft_wrap=True)
    raise typer.Exit(1)


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (of the driver's error, for SQLAlchemy), else its type."""
    text = str(getattr(exc, "orig", None) or exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


# OS errors about a path an operator names or owns (a folder that is a file, no permission): one line, not a
# traceback. Only these, and only with a path: any other OSError may be a bug, whose traceback is wanted.
_PATH_ERRORS = (PermissionError, FileExistsError, NotADirectoryError, IsADirectoryError)


def reporting_errors(func: F) -> F:
    """Wrap a command so Shoal's own errors, an unreachable broker and an OS error about a named path (no
    permission, a file where a folder should be) end it with one line and status 1."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except ShoalError as exc:
            fail(str(exc))
        except (redis.exceptions.ConnectionError, kombu.exceptions.OperationalError) as exc:
            # kombu's: a publish (the intake's Publisher) to a broker that went away.
            fail(f"cannot reach the broker: {first_line(exc)}")
        except _PATH_ERRORS as exc:
            if exc.filename is None:
                raise
            fail(f"{exc.strerror or type(exc).__name__}: {exc.filename}")

    return wrapper  # type: ignore[return-value]


class ShoalTyper(typer.Typer):
    """A Typer whose commands report ShoalError as a message, never a traceback."""

    def command(self, *args: Any, **kwargs: Any) -> Callable[[F], F]:  # type: ignore[override]
        register = super().command(*args, **kwargs)

        def decorator(func: F) -> F:
            register(reporting_errors(func))
            return func

        return decorator


def typer_app(help_text: str) -> ShoalTyper:
    """A command group with Shoal's conventions: help when called bare, no locals in tracebacks."""
    # Locals are never shown: they may hold settings with secrets.
    return ShoalTyper(
        help=help_text, no_args_is_help=True, pretty_exceptions_show_locals=False, rich_markup_mode="markdown"
    )


# SHOAL_* variables that are no setting but are read directly: the config file's name, and the tests' and
# benchmarks' own (those under a prefix of their own as a whole).
_OTHER_VARIABLES = frozenset({"SHOAL_CONFIG", "SHOAL_SHARED_DATA", "SHOAL_WIRE_EXAMPLES", "SHOAL_WIRE_RANDOM",
                              "SHOAL_CATALOG_BENCH_TAG"})
_OTHER_PREFIXES = ("SHOAL_TEST_", "SHOAL_BENCH_")
_warned_variables: set[str] = set()  # each unknown variable is warned about once per process


def unknown_variables(environ: Mapping[str, str]) -> list[str]:
    """Warnings, one per SHOAL_* variable of `environ` that is no setting (nor a variable Shoal reads itself),
    naming the nearest setting when one is close: a misspelt variable is otherwise silently ignored."""
    known = {f"SHOAL_{name.upper()}" for name in Settings.model_fields}
    # Matched without the prefix all share: "SHOAL_" alone would make any two names look alike.
    suffixes = sorted(name.removeprefix("SHOAL_") for name in known)
    warnings = []
    for key in sorted(environ):
        name = key.upper()  # pydantic-settings reads variables case-insensitively
        if not name.startswith("SHOAL_") or name in known or name in _OTHER_VARIABLES:
            continue
        if name.startswith(_OTHER_PREFIXES):
            continue
        near = difflib.get_close_matches(name.removeprefix("SHOAL_"), suffixes, n=1)
        warnings.append(f"{key} is no setting" + (f"; did you mean SHOAL_{near[0]}?" if near else " (ignored)"))
    return warnings


def load_settings() -> Settings:
    """The effective settings; ConfigurationError listing every invalid one (instead of pydantic's report).

    A missing, unreadable or malformed config file is a ConfigurationError of Settings itself, naming the file.
    A SHOAL_* variable that is no setting is not refused (scripts may export others) but warned about on stderr,
    once per process.
    """
    for warning in unknown_variables(os.environ):
        if warning not in _warned_variables:
            _warned_variables.add(warning)
            err.print(Text("warning: " + warning, style="bold yellow"), soft_wrap=True)
    try:
        return Settings()
    except pydantic.ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'settings'}: {e['msg']}" for e in exc.errors()
        )
        raise ConfigurationError(f"invalid settings: {problems}") from None


# The tenant a CLI call works in when none is named: it needs no creating, so `existing` never refuses it.
DEFAULT_TENANT = str(Settings.model_fields["tenant"].default)


@contextlib.contextmanager
def open_shoal(tenant: str | None, settings: Settings | None = None, *, existing: bool = False) -> Iterator[Shoal]:
    """A Shoal on the given (else the configured) tenant, closed when the block ends.

    A Shoal creates its tenant on first use. With `existing` (commands that only read, or work on what must
    exist already), a tenant the catalog does not hold is NotFoundError instead, and is not created: a
    mistyped --tenant must not leave a tenant behind. DEFAULT_TENANT is exempt (a fresh install lists nothing).
    """
    settings = settings or load_settings()
    if not existing:
        with Shoal(settings, tenant=tenant) as shoal:
            yield shoal
        return
    name = check_tenant_name(tenant or settings.tenant)
    runtime = Runtime(settings)
    try:
        if name != DEFAULT_TENANT and not tenant_exists(runtime.engine, name):
            raise NotFoundError(f"tenant {name!r} not found (`shoal tenant list` shows the tenants)")
        with Shoal(runtime=runtime, tenant=name) as shoal:
            yield shoal
    finally:
        runtime.close()


def split_all(values: list[str] | None) -> list[str]:
    """Repeated options that may also be comma-separated, as one flat list without blanks."""
    return [part.strip() for value in values or [] for part in value.split(",") if part.strip()]


def split_pairs(
    values: list[str] | None, sep: str, form: str, option: str, *, commas: bool = True
) -> list[tuple[str, str]]:
    """Items of split_all (with `commas` False: the values as given, blanks dropped) written LEFT<sep>RIGHT,
    stripped; a usage error naming `form` for any other item."""
    pairs = []
    items = split_all(values) if commas else [v for v in values or [] if v.strip()]
    for item in items:
        left, found, right = item.partition(sep)
        if not found or not left.strip() or not right.strip():
            raise typer.BadParameter(f"{item!r} is not {form}", param_hint=option)
        pairs.append((left.strip(), right.strip()))
    return pairs

