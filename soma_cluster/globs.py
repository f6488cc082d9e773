"""Glob patterns on a corpus file's path relative to the corpus root (corpus.source_patterns): the pattern language,
checked when the config is read. A leaf module: soma_cluster.config imports it.

The rules are git's (.gitignore), which researchers already write:
- `*` is any run of characters within one name, `?` one character, `[abc]`/`[a-z]`/`[!a]` one of a set;
- `**` as a whole name is any number of folders (`perl/**`, `**/man1/*`, `docs/**/*.md`);
- a pattern without a `/` matches a name at any depth (`*.pm`, `man1`); one with a `/` (`perl/*.pm`, `/README`)
  is matched from the corpus root;
- a pattern that matches a folder matches every file under it (`perl`, `perl/`, `src/*/tests`); a trailing `/`
  matches folders only.
Matching is case-sensitive, on the path as listed (a name that is not UTF-8 as its escaped text).
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Glob:
    pattern: str  # as written
    regex: re.Pattern  # a full match of a path, or of one of its folders (see matches)
    anywhere: bool  # no "/" in the pattern: tried on every name of the path
    folders_only: bool  # a trailing "/"

    def matches(self, path: str) -> bool:
        """Whether the file at `path` ("a/b/c.txt", relative to the root) matches: itself, or a folder above it."""
        names = path.split("/")
        if self.anywhere:
            tried = names[:-1] if self.folders_only else names
            return any(self.regex.fullmatch(n) for n in tried)
        prefixes = ["/".join(names[:i]) for i in range(1, len(names))] + ([] if self.folders_only else [path])
        return any(self.regex.fullmatch(p) for p in prefixes)


def compile_glob(pattern: str) -> Glob:
    """The pattern compiled; a pattern that cannot match any relative path, or is malformed, is a ValueError
    saying why and how to write it."""
    if not pattern.strip():
        raise ValueError("an empty pattern matches nothing; write e.g. 'perl/**' or '*.pm'")
    body = pattern[1:] if pattern.startswith("/") else pattern  # a leading "/" anchors at the root, as in git
    folders_only = body.endswith("/")
    body = body.rstrip("/")
    names = body.split("/")
    if not body or "" in names:
        raise ValueError(f"pattern {pattern!r} has an empty folder name (//); write one / between names")
    if any(n in (".", "..") for n in names):
        raise ValueError(
            f"pattern {pattern!r} has a '.' or '..' folder, which no path relative to the corpus root has; "
            "write the path from the corpus root (e.g. 'perl/**')"
        )
    anywhere = "/" not in body and not pattern.startswith("/")
    parts = []
    for name in names:
        if name == "**":
            parts.append(None)
        elif "**" in name:
            raise ValueError(
                f"pattern {pattern!r}: '**' must be a whole folder name ('a/**/b'), not part of one; use '*' within "
                "a name"
            )
        else:
            parts.append(_name_regex(name, pattern))
    try:
        regex = re.compile(_join(parts), re.DOTALL)
    except re.error as exc:  # a set such as [z-a] or [!]
        raise ValueError(
            f"pattern {pattern!r} has a malformed [set] ({exc.msg}); write e.g. '[a-z]' or '[!.]'"
        ) from None
    return Glob(pattern, regex, anywhere, folders_only)


def _join(parts: list[str | None]) -> str:
    """Names' regexes joined by "/", where None (a `**`) is any number of folders, none included."""
    out = ""
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        if part is None:
            out += ".*" if last else "(?:[^/]*/)*"
        else:
            out += part + ("" if last else "/")
    return out


def _name_regex(name: str, pattern: str) -> str:
    """One name's glob as a regex that never crosses a "/"."""
    out, i = "", 0
    while i < len(name):
        c = name[i]
        if c == "*":
            out += "[^/]*"
        elif c == "?":
            out += "[^/]"
        elif c == "[":
            end = name.find("]", i + 2 if name[i + 1 : i + 2] in ("!", "]") else i + 1)
            if end < 0:
                raise ValueError(
                    f"pattern {pattern!r} has a '[' with no closing ']'; close the set (e.g. '[a-z]') or write '[[]' "
                    "for a literal '['"
                )
            body = name[i + 1 : end]
            negate = body.startswith("!")
            body = body[1:] if negate else body
            # escaped: a "]" first is a member, and Python's set operators ("&&", "~~", "[") are literal in a glob
            members = "".join("\\" + ch if ch in "\\[]^&~|" else ch for ch in body)
            out += "[" + "^" * negate + members + "]"
            i = end
        else:
            out += re.escape(c)
        i += 1
    return out
