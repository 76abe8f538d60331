"""The manuals stay readable as GitHub renders them: every link from README.md, BENCHMARKS.md
and docs/ to a file of the repository, or to a heading in one, resolves, and every table has its
separator row and the header's number of cells in each row. A table that loses its separator
renders as a wall of pipes, and a heading renamed in BENCHMARKS.md silently breaks the README's
links to its figures."""

import functools
import glob
import os
import re

import pytest

from support import REPO

MANUALS = sorted(["README.md", "BENCHMARKS.md"]
                 + [os.path.relpath(p, REPO) for p in glob.glob(os.path.join(REPO, "docs", "*.md"))])
LINK = re.compile(r"\]\(([^)\s]+)\)")
EXPLICIT_ANCHOR = re.compile(r'<a id="([^"]+)"')


def prose_lines(path):
    """The file's lines outside fenced code blocks, with their numbers."""
    fenced = False
    with open(os.path.join(REPO, path)) as f:
        for number, line in enumerate(f, 1):
            if line.lstrip().startswith("```"):
                fenced = not fenced
                continue
            if not fenced:
                yield number, line.rstrip("\n")


def slug(heading):
    """GitHub's anchor for a heading: lowercased, punctuation but '-' and '_' dropped, spaces to '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@functools.lru_cache(maxsize=None)  # a manual links to itself a hundred times over: read it once
def anchors(path):
    found, seen = set(), {}
    for _, line in prose_lines(path):
        heading = re.match(r"^#{1,6}\s+(.*)", line)
        if heading:
            base = slug(heading.group(1))
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")  # GitHub numbers repeated headings
        found.update(EXPLICIT_ANCHOR.findall(line))
    return frozenset(found)


def cells(row):
    """A table row's cell count: pipes inside code spans and escaped pipes do not split cells."""
    code, count, previous = False, 0, ""
    for ch in row:
        if ch == "`":
            code = not code
        elif ch == "|" and not code and previous != "\\":
            count += 1
        previous = ch
    return count


@pytest.mark.parametrize("manual", MANUALS)
def test_every_link_to_a_file_or_heading_of_the_repository_resolves(manual):
    broken = []
    for number, line in prose_lines(manual):
        for target in LINK.findall(line):
            if re.match(r"^[a-z]+:", target):  # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            resolved = os.path.normpath(os.path.join(os.path.dirname(manual), path)) if path else manual
            if not os.path.exists(os.path.join(REPO, resolved)):
                broken.append(f"{manual}:{number}: {target} (no file {resolved})")
            elif anchor and resolved.endswith(".md") and anchor not in anchors(resolved):
                broken.append(f"{manual}:{number}: {target} (no heading or anchor '{anchor}' in {resolved})")
    assert not broken, "links that do not resolve:\n" + "\n".join(broken)


@pytest.mark.parametrize("manual", MANUALS)
def test_every_table_has_its_separator_row_and_even_rows(manual):
    problems, header = [], None
    for number, line in prose_lines(manual):
        if not line.startswith("|"):
            header = None
            continue
        if header is None:  # the first row of a table
            header = (number, cells(line))
        elif number == header[0] + 1 and not re.match(r"^\|\s*:?-", line):
            problems.append(f"{manual}:{header[0]}: a table with no separator row under its header")
        elif cells(line) != header[1]:
            problems.append(f"{manual}:{number}: {cells(line) - 1} cells where the header has {header[1] - 1}")
    assert not problems, "\n".join(problems)
