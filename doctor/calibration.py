"""Calibration prompts for `doctor --probe`: short openings of the kinds of text small code-and-prose models see.

The probe lets the target continue each prompt greedily, so the draft is judged on the target's own text.
"""

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
