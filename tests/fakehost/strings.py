"""Strings that break naive command building: each must arrive byte-exact as ONE argv element."""

HOSTILE = [
    "it's",
    'say "hi"',
    "$(touch /tmp/pwned)",
    "`id`",
    "a; rm -rf /",
    "true && false",
    "line1\nline2",
    "*",
    "?",
    "[abc]",
    "ünïcødé ✓ 中文",
    "-n",
    "--help",
    "--",
    "",
    "  spaced  out  ",
    "back\\slash\\",
    "$HOME ${PATH}",
    "tab\there",
    "'",
    '"',
    "!event",
    "~root",
    "a|b>c<d&",
    "#comment",
    "\r\n",
]

# Prints its arguments as one JSON list (compare with HOSTILE after json.loads).
PRINT_ARGV = "import json, sys; sys.stdout.write(json.dumps(sys.argv[1:]))"
