"""The help formatter of every `tokenmill` command (its own module: `cli` and `bench.cli` both use it)."""
from __future__ import annotations

import argparse
import copy


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's default in `--help`, as vLLM shows them: appended to its help text, or as the help
    of an option that has none; a help text that already says what its default is keeps its words."""

    def _get_help_string(self, action):
        if "default" in (action.help or "").lower():
            return action.help
        return super()._get_help_string(action)

    def _format_action(self, action):
        if action.help is None and action.default is not argparse.SUPPRESS and (
                action.option_strings or action.nargs in ("?", "*")):
            action = copy.copy(action)
            action.help = "(default: %(default)s)"
        return super()._format_action(action)
