"""Calibration prompts for `doctor --probe`: short openings of the kinds of text small code-and-prose models see.

The probe lets the target continue each prompt greedily, so the draft is judged on the target's own text.
"""

from __future__ import annotations

from pathlib import Path


class CalibrationError(ValueError):
    """The user's prompts file cannot be used; the message says why."""


CALIBRATION_PROMPTS = [
    "def read_config(path):\n    \"\"\"Read a JSON configuration file and return it as a dictionary.\"\"\"\n",
    "import os\nimport sys\n\n\ndef main():\n    args = sys.argv[1:]\n",
    "class Cache:\n    def __init__(self, size):\n        self.size = size\n",
    "    for name, value in sorted(items.items()):\n        if value is None:\n",
    "try:\n    import json\nexcept ImportError:\n",
    "def test_parse_empty_string(self):\n        self.assertEqual(",
    "    @property\n    def name(self):\n        return self._name\n\n",
    "    if not os.path.exists(filename):\n        raise FileNotFoundError(",
    "The module provides functions for working with files and directories. ",
    "This function returns a new list containing the elements of the sequence ",
    "Return True if the object is an instance of the class, and False otherwise. ",
    "The following example shows how to open a file for reading and print each line:\n\n",
    "Note that the default value is evaluated only once, when the function is defined. ",
    "Changed in version 3.8: the parameter is now optional, and ",
    "Raises ValueError if the string is not a valid number. ",
    "A thread is a separate flow of execution. This means that your program will ",
]


def calibration_prompts(prompts_file: Path | None = None) -> list[str]:
    """The shipped prompts, or the user's: a text file, one prompt a line (blank lines skipped)."""
    if prompts_file is None:
        return list(CALIBRATION_PROMPTS)
    try:
        prompts = [line for line in prompts_file.read_text().splitlines() if line.strip()]
    except OSError as exc:
        raise CalibrationError(f"cannot read the prompts file {prompts_file}: {exc.strerror}") from None
    if not prompts:
        raise CalibrationError(f"{prompts_file} holds no prompts (one a line)")
    return prompts
