"""The `tuneloop` command. Server commands import the server stack only when run."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

HELP = """tuneloop: a self-hosted server for the Tinker training API, and its tools.

Exit codes: 0 ok, 1 not found (or the operation failed), 2 bad usage or bad input.
"""
# Commands that never need the demo: building the command line for them skips importing it,
# so `serve` (started as a child process by clients) neither waits for nor depends on it.
_NOT_DEMO = frozenset({"serve", "deploy", "keys", "runs", "checkpoints", "usage"})


def _version(value: bool) -> None:
    if value:
        from tuneloop import __version__

        typer.echo(__version__)
        raise typer.Exit(0)


def build_app(*, with_demo: bool = True) -> typer.Typer:
    app = typer.Typer(
        name="tuneloop",
        help=HELP,
        no_args_is_help=True,
        add_completion=False,
        rich_markup_mode="markdown",
        # Plain tracebacks: rich's would print local variables' values, API keys included.
        pretty_exceptions_enable=False,
    )

    @app.callback()
    def _root(
        version: Annotated[
            bool,
            typer.Option(
                "--version", help="Print the version and exit.", is_eager=True, callback=_version
            ),
        ] = False,
    ) -> None:
        # Only here for --version, which its eager callback answers before any command runs.
        return None

    try:
        from tuneloop.server.cli import register
    except ImportError as exc:  # the bare install is the SDK only
        reason = str(exc)

        @app.command(
            "serve",
            context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
            help="Run the tuneloop server (needs tuneloop[server]).",
        )
        def _missing() -> None:
            typer.echo(
                f"error: the server commands need `pip install 'tuneloop[server]'` ({reason})",
                err=True,
            )
            raise typer.Exit(2)

    else:
        register(app)
    if with_demo:
        try:
            from tuneloop.recipes.demo import demo_command
        except ImportError:  # the recipes are optional: no demo command then
            pass
        else:
            app.command("demo")(demo_command)
            from tuneloop.recipes.cli import recipe_app

            app.add_typer(recipe_app(), name="recipe")
    return app


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    app = build_app(with_demo=not args or args[0] not in _NOT_DEMO)
    try:
        app(args=args, prog_name="tuneloop")
    except SystemExit as exc:
        code = exc.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
