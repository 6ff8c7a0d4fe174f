"""The docs hold together: every relative link resolves, every results file a page cites
exists, the results pages are what ``bench/report.py`` makes of ``bench/results/``, and
the reference pages name no commits (measurements of particular commits live in
``docs/results/``)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.conftest import load_bench

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
REFERENCE = sorted(p for p in (REPO / "docs").rglob("*.md")
                   if (REPO / "docs" / "results") not in p.parents)
# [text](target) with a target that is not a URL or a pure anchor
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
# 7 to 40 hex digits, at least one digit and one of a-f (so no English word such as
# "defaced" and no plain number), not part of a longer word
HEX = re.compile(r"(?<![\w-])(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}(?![\w-])")
# what stands before a hash when the text names a commit: "commit 68e478d", "at 68e478d",
# "(68e478d", "`68e478d`"
BEFORE = re.compile(r"(?:\bcommits?|\b(?:at|since|after|before|on|of))\W{1,3}$|[`(]$")

report = load_bench("report")


def relative_links(text: str) -> list[str]:
    """The link targets of a Markdown text that point into the repository."""
    return [t for t in LINK.findall(text) if not re.match(r"^[a-z]+:|^#", t)]


def commits_in_repo(words: set[str]) -> set[str]:
    """Those of ``words`` that name a commit of this repository (none without git)."""
    if not words or shutil.which("git") is None:
        return set()
    order = sorted(words)
    out = subprocess.run(["git", "cat-file", "--batch-check"], cwd=REPO, text=True,
                         input="".join(f"{w}^{{commit}}\n" for w in order),
                         capture_output=True).stdout.splitlines()
    return {w for w, line in zip(order, out, strict=False) if " commit " in line}


def commit_hashes(text: str) -> list[str]:
    """Commit hashes a text cites: a hex word in a commit's place (after "commit", "at",
    "since", ..., in parentheses or backticks), or any hex word that names a commit of
    this repository."""
    found = [(m.group(), bool(BEFORE.search(text[max(0, m.start() - 12):m.start()])))
             for m in HEX.finditer(text)]
    known = commits_in_repo({w for w, placed in found if not placed})
    return [w for w, placed in found if placed or w in known]


def test_relative_links_are_found() -> None:
    text = "see [a](docs/a.md), [b](https://x.org), [c](#top) and [d](../x.py#L3)"
    assert relative_links(text) == ["docs/a.md", "../x.py#L3"]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_links_resolve(page: Path) -> None:
    missing = []
    for target in relative_links(page.read_text()):
        path = (page.parent / target.split("#", 1)[0]).resolve()
        if not path.exists():
            missing.append(target)
    assert not missing, f"{page.relative_to(REPO)}: links to nothing: {missing}"


def test_every_results_file_the_docs_cite_exists(tmp_path: Path) -> None:
    missing = report.cited_results(PAGES)
    assert not missing, f"cited results files that do not exist: {missing}"
    page = tmp_path / "page.md"
    page.write_text("see `bench/results/outage.json` and bench/results/no-such-bench.json")
    assert report.cited_results([page]) == {"bench/results/no-such-bench.json": [str(page)]}


def test_every_results_file_is_cited_by_a_reference_page_and_every_named_one_exists() -> None:
    uncited = report.uncited_results()
    assert not uncited, (f"no page of README.md or docs/ names {uncited} or links the "
                         "results page that renders it: cite the current result of a "
                         "question, remove a superseded file (git keeps it)")
    missing = report.missing_named()
    assert not missing, f"pages name results files that do not exist: {missing}"


def test_a_results_file_is_cited_by_name_or_by_its_results_page(tmp_path: Path) -> None:
    results = tmp_path / "results"
    results.mkdir()
    for name in ("outage.json", "learning-a.json", "learning-b.json"):
        (results / name).write_text("{}")
    page = tmp_path / "page.md"
    page.write_text("As `learning-a.json` shows; runs kept in bench/progress/learning-b.json; "
                    "config.json is a model file.")
    assert report.uncited_results(results, [page]) == ["learning-b.json", "outage.json"]
    page.write_text("See [results](results/outage.md), bench/results/learning-b.json and "
                    "`learning-a.json`, `learning-gone.json`.")
    assert report.uncited_results(results, [page]) == []
    assert report.missing_named(results, [page]) == {"learning-gone.json": [str(page)]}


def test_results_pages_are_up_to_date_with_their_json() -> None:
    problems = report.check()
    assert not problems, "\n".join(problems) + "\nrun: python bench/report.py"


def test_a_stale_missing_or_left_over_results_page_is_named(tmp_path: Path) -> None:
    results, pages = tmp_path / "results", tmp_path / "pages"
    results.mkdir()
    pages.mkdir()
    data = {"meta": {"bench": "outage", "command": "python bench/outage.py", "commit": "1234abc",
                     "date": "2026-01-02"},
            "results": [{"outage_s": 0.0, "per_component_s": {"a": 1.5}, "all_components_s": 1.5}]}
    (results / "outage.json").write_text(json.dumps(data))
    assert report.check(results, pages, docs=[]) == ["docs/results/outage.md: missing",
                                            "docs/results/README.md: missing"]
    for name, text in report.pages(results).items():
        (pages / name).write_text(text)
    assert report.check(results, pages, docs=[]) == []
    page = (pages / "outage.md").read_text()
    assert "- commit: `1234abc`" in page and "- machine: not recorded" in page
    assert "| none (baseline) | 1.50 | a | 0 |" in page
    data["results"][0]["all_components_s"] = 2.5
    (results / "outage.json").write_text(json.dumps(data))
    (pages / "old.md").write_text("gone")
    assert report.check(results, pages, docs=[]) == ["docs/results/outage.md: stale",
                                            "docs/results/old.md: no results file makes it"]


def test_commit_hashes_are_found_where_the_text_names_a_commit() -> None:
    assert commit_hashes("measured at commit 68e478d, 2 cores") == ["68e478d"]
    assert commit_hashes("`bench/x.py` (cd11dd9) and `e1ec39d`") == ["cd11dd9", "e1ec39d"]
    assert commit_hashes("not re-run after 584c379a") == ["584c379a"]
    head = subprocess.run(["git", "rev-parse", "--short=9", "HEAD"], cwd=REPO, text=True,
                          capture_output=True).stdout.strip()
    if re.fullmatch(HEX, head):  # a commit of this repository, wherever it stands
        assert commit_hashes(f"the runs {head} made") == [head]
    ordinary = ("signs with an ed25519 key; a defaced 1234567 records; sha256 "
                + "ab" * 32 + "; bf16 and fp32 at 1e-4")
    assert commit_hashes(ordinary) == []


@pytest.mark.parametrize("page", REFERENCE, ids=lambda p: str(p.relative_to(REPO)))
def test_reference_pages_cite_no_commit(page: Path) -> None:
    cited = commit_hashes(page.read_text())
    assert not cited, (f"{page.relative_to(REPO)} names commits {cited}: measurements of "
                       "particular commits go to bench/results/ and docs/results/")


def test_run_meta_names_the_command_commit_machine_and_date() -> None:
    meta = report.run_meta("outage", ["python", str(REPO / "bench" / "outage.py"),
                                      "--lengths", "0,10", "--out", "a b.json"])
    assert meta["bench"] == "outage"
    assert meta["command"] == "python bench/outage.py --lengths 0,10 --out 'a b.json'"
    assert re.fullmatch(r"[0-9a-f]{7}( with uncommitted changes)?", meta["commit"])
    assert re.search(r", \d+ cores(, [^()]+)? \(", meta["machine"])
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", meta["date"])
    assert meta["packages"]["python"].count(".") == 2
    assert {"torch", "confluent-kafka"} <= set(meta["packages"])  # installed here
    assert all(f.startswith(("avx", "amx", "fma", "f16c")) for f in meta["cpu_flags"])


def test_the_machine_names_the_flags_that_make_two_cpus_of_one_name_differ(tmp_path) -> None:
    def on(flags: str) -> str:
        cpuinfo = tmp_path / "cpuinfo"
        cpuinfo.write_text(f"model name\t: AMD EPYC\nflags\t\t: fpu sse2 {flags}\n\n"
                           "model name\t: AMD EPYC\nflags\t\t: fpu\n")
        return report.machine(cpuinfo)

    assert ", no AVX512 (" in on("avx2")
    assert ", avx512_bf16 avx512f (" in on("avx2 avx512f avx512_bf16")
    assert ", amx_bf16 avx512_bf16 avx512f (" in on("amx_bf16 avx512f avx512_bf16")
    assert re.search(r", \d+ cores \(", report.machine(tmp_path / "none"))  # no flags known
