"""The documentation site: it builds with warnings as errors, every internal link resolves, and it renders.

The site is built from this checkout (``mkdocs build --strict`` into a
temporary folder, as scripts/test.sh does into site/). Then:

- every ``href`` and ``src`` inside the built site points at a file that
  exists, and every ``#anchor`` at an ``id`` on the target page; nothing the
  pages load (scripts, stylesheets, images) comes from another host, so a
  browser opening the site reaches no network;
- the README's relative links point at files of the repository, and its
  ``#anchors`` at its own headings;
- headless Chromium opens the home page, the API page and the migration
  page from a local HTTP server: the rendered DOM holds the expected text, and the screenshots are
  real images, not blank. Without Chromium (``apt-get install chromium``;
  scripts/setup.sh installs it as root) this test skips, saying so, except
  under CI (the ``CI`` variable set) running as root, where it fails: there
  setup.sh installs it, so a missing one is a broken set-up. A CI without
  root cannot install it, and skips, saying what to install.
"""

from __future__ import annotations

import functools
import http.server
import os
import re
import shutil
import subprocess
import sys
import threading
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

from harness import run_command

ROOT = Path(__file__).resolve().parent.parent
BROWSER_TIMEOUT_S = 120
# Chromium reaching no network and keeping no state: no QUIC, no first-run,
# background or component-update traffic, a fresh profile per run.
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",  # CI runs as root
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
    "--window-size=1280,900",
]


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """The site built from this checkout, with warnings as errors."""
    try:
        import mkdocs  # noqa: F401
    except ImportError:
        _missing("mkdocs (the docs extra: pip install -e '.[docs]')")
    out = tmp_path_factory.mktemp("site")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    build = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "--site-dir", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert build.returncode == 0, f"mkdocs build --strict failed:\n{build.stdout}\n{build.stderr}"
    return out


def _missing(what: str, *, needs_root: bool = False) -> None:
    """Skips, saying what is missing; fails under CI where scripts/setup.sh would have installed it."""
    if os.environ.get("CI") and not (needs_root and os.geteuid() != 0):
        pytest.fail(f"{what} is missing, and CI must not skip the docs site test (scripts/setup.sh installs it)")
    if needs_root and os.environ.get("CI"):
        pytest.skip(f"{what} is missing, and this CI runs without root, so scripts/setup.sh could not install it")
    pytest.skip(f"{what} is missing")


@pytest.mark.parametrize(
    "ci, uid, outcome",
    [("", 0, "skip"), ("", 1000, "skip"), ("true", 0, "fail"), ("true", 1000, "skip without root")],
)
def test_a_missing_browser_skips_saying_why_or_fails_where_ci_could_install_it(monkeypatch, ci, uid, outcome):
    monkeypatch.setenv("CI", ci)
    monkeypatch.setattr(os, "geteuid", lambda: uid)
    expected = pytest.fail.Exception if outcome == "fail" else pytest.skip.Exception
    with pytest.raises(expected) as raised:
        _missing("chromium", needs_root=True)
    assert ("without root" in str(raised.value)) == (outcome == "skip without root"), str(raised.value)
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(pytest.fail.Exception if ci else pytest.skip.Exception):
        _missing("mkdocs")  # pip installs it without root: CI fails without it


class _Links(HTMLParser):
    # Every link, source and id of one HTML page.
    def __init__(self) -> None:
        super().__init__()
        self.links: list[tuple[str, str, str]] = []  # (tag, attribute, value)
        self.ids: set[str] = set()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        for name, value in attrs:
            if value is None:
                continue
            if name in ("href", "src"):
                self.links.append((tag, name, value))
            elif name in ("id", "name") and tag != "meta":
                self.ids.add(value)


@functools.lru_cache(maxsize=None)
def _parse(page: Path) -> _Links:
    parser = _Links()
    parser.feed(page.read_text(encoding="utf-8"))
    return parser


def test_every_internal_link_and_anchor_resolves(site):
    pages = sorted(site.rglob("*.html"))
    assert len(pages) >= 15, f"only {len(pages)} pages built"
    broken, remote = [], []
    checked = 0
    for page in pages:
        for tag, attribute, value in _parse(page).links:
            url = urlsplit(value)
            if url.scheme or url.netloc:
                # A page may link out; what it loads must be local.
                if url.scheme in ("http", "https", "") and (tag != "a" or attribute == "src"):
                    remote.append(f"{page.relative_to(site)}: <{tag} {attribute}={value}>")
                continue
            if url.path.startswith("/"):  # 404.html's links: from the root the site is served at
                target = site / unquote(url.path).lstrip("/")
            else:
                target = (page.parent / unquote(url.path)).resolve() if url.path else page
            if target.is_dir():
                target = target / "index.html"
            checked += 1
            if not target.is_file():
                broken.append(f"{page.relative_to(site)}: {value} (no file {target})")
            elif url.fragment and target.suffix == ".html" and unquote(url.fragment) not in _parse(target).ids:
                broken.append(f"{page.relative_to(site)}: {value} (no id {url.fragment!r} there)")
    assert checked > 500, f"only {checked} internal links found: is the parser still finding them?"
    assert not broken, "broken internal links:\n" + "\n".join(broken)
    assert not remote, "pages load resources from other hosts:\n" + "\n".join(remote)


def test_the_benchmark_results_are_on_the_site(site):
    current = sorted(path.stem for path in (ROOT / "benchmarks" / "results").glob("*.md"))
    assert len(current) >= 10, current
    for name in (*current, "archive/latest"):
        assert (site / "results" / f"{name}.html").is_file(), f"results/{name}.md is not on the site"
    assert (site / "results" / "ddp_loopback_ratios.png").is_file()


def _github_slug(heading: str) -> str:
    # How GitHub names a heading's anchor: lower case, punctuation dropped, spaces to dashes.
    text = re.sub(r"[`*_]", "", heading.strip()).lower()
    return re.sub(r"\s", "-", re.sub(r"[^\w\s-]", "", text))


def _markdown_anchors(text: str) -> set[str]:
    without_code = re.sub(r"```.*?```", "", text, flags=re.DOTALL)
    return {_github_slug(h) for h in re.findall(r"^#+ (.+)$", without_code, flags=re.MULTILINE)}


def test_the_readme_links_resolve():
    text = (ROOT / "README.md").read_text()
    targets = re.findall(r"\]\(([^)\s]+)\)", re.sub(r"```.*?```", "", text, flags=re.DOTALL))
    assert len(targets) >= 15, f"only {len(targets)} links in the README"
    broken = []
    for target in targets:
        url = urlsplit(target)
        if url.scheme or url.netloc:
            continue
        path = ROOT / unquote(url.path) if url.path else ROOT / "README.md"
        if not path.exists():
            broken.append(f"{target}: no such file")
        elif url.fragment and path.suffix == ".md" and url.fragment not in _markdown_anchors(path.read_text()):
            broken.append(f"{target}: no such heading in {path.name}")
    assert not broken, "broken README links:\n" + "\n".join(broken)


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 (the base class's name)
        pass


@pytest.fixture(scope="module")
def served(site):
    """The built site over HTTP on 127.0.0.1 (a free port): its base URL."""
    handler = functools.partial(_QuietHandler, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def _chromium(*arguments: str, profile: Path) -> str:
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        _missing("chromium (apt-get install chromium, as root)", needs_root=True)
    try:  # in its own session, killed whole (the browser and its helper processes) on timeout
        done = run_command(
            [browser, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *arguments], timeout=BROWSER_TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"chromium still running after {BROWSER_TIMEOUT_S} s: {arguments}")
    assert done.returncode == 0, f"chromium exited {done.returncode}: {done.stderr[-3000:]}"
    return done.stdout


def _assert_real_screenshot(path: Path) -> None:
    from matplotlib.image import imread

    pixels = imread(path)  # floats in [0, 1], height x width x channels
    assert pixels.shape[:2] == (900, 1280), f"{path}: {pixels.shape}"
    rgb = pixels[..., :3]
    colours = len({tuple(p) for p in (rgb[::7, ::7] * 255).round().reshape(-1, 3).tolist()})
    assert rgb.std() > 0.05 and colours > 20, f"{path} looks blank: std {rgb.std():.3f}, {colours} colours"
    assert rgb[:48].mean() < 0.8, f"{path}: no header bar at the top (is the theme's stylesheet loading?)"


# (page, texts the rendered DOM must hold)
PAGES = {
    "index.html": ["<title>torchreplicate</title>", "Why switch from DDP", "Status: alpha", "GPU and NCCL have never"],
    "api.html": [
        "API reference",
        "ignored_modules",
        "bucket_cap_mb",
        "a data-parallel replica, in place, and returns it",
        "set_requires_gradient_sync",
        "verify_replicas",
        "FabricReplicateStrategy",
    ],
    "migration.html": [
        "Where it differs from DDP",
        "isinstance(model, DistributedDataParallel)",
        "bucket_layout",
        "_register_builtin_comm_hook",
        "stall_timeout=None",
    ],
}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("page", sorted(PAGES))
def test_the_page_renders_in_a_headless_browser(served, page, tmp_path):
    url = f"{served}/{page}"
    dom = _chromium("--dump-dom", url, profile=tmp_path / "profile-dom")
    for text in PAGES[page]:
        assert text in dom, f"{page}: {text!r} not in the rendered page"
    keep = os.environ.get("TORCHREPLICATE_SCREENSHOTS")  # a folder to keep the screenshots in, to look at
    screenshot = (Path(keep) if keep else tmp_path) / f"{Path(page).stem}.png"
    screenshot.parent.mkdir(parents=True, exist_ok=True)
    _chromium(f"--screenshot={screenshot}", url, profile=tmp_path / "profile-shot")
    _assert_real_screenshot(screenshot)


def test_every_page_links_resolve_as_plain_markdown():
    # The pages read as plain Markdown too (a clone, a code host): each relative link names a file of
    # the repository and, where it has one, a heading of that page. One mapping is the site's own:
    # results/NAME is benchmarks/results/NAME (docs/hooks/results.py copies it there; the README says so).
    broken, checked = [], 0
    for page in sorted((ROOT / "docs").glob("*.md")):
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.DOTALL)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            url = urlsplit(target)
            if url.scheme or url.netloc:
                continue
            checked += 1
            relative = unquote(url.path)
            if relative.startswith("results/"):
                relative = "../benchmarks/" + relative
            path = (page.parent / relative).resolve() if relative else page
            if not path.exists():
                broken.append(f"{page.name}: {target}: no such file")
            elif url.fragment and path.suffix == ".md" and url.fragment not in _markdown_anchors(path.read_text()):
                broken.append(f"{page.name}: {target}: no such heading in {path.name}")
    assert checked > 150, f"only {checked} relative links found on the pages"
    assert not broken, "links that do not resolve as plain Markdown:\n" + "\n".join(broken)


# Files a page names that are the reader's, not the repository's (a script they write, a folder they pass).
READERS_FILES = {
    "replicate_demo.py",
    "accumulate_demo.py",
    "summary.json",
    "log.txt",
    "tracebacks.txt",
    "config.json",
    "hf_prepare_model.py",
    "replica_groups.py",
    "archive/NAME.json",
}
# Where a page's short path may live: as written, under the package, beside the results, or in the
# benchmarks' folder of its question.
BENCHMARK_FOLDERS = tuple(f"benchmarks/{path.name}/" for path in sorted((ROOT / "benchmarks").glob("*/")))
PATH_ROOTS = ("", "src/torchreplicate/", "src/", "tests/", "docs/", "benchmarks/", "scripts/", *BENCHMARK_FOLDERS)


def test_every_file_a_page_names_exists():
    # issue 60: six paths in the docs pointed at files that had moved
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    pattern = re.compile(r"`([A-Za-z0-9_./-]+\.(?:py|sh|json|md|toml|png|yml|yaml|cfg|txt))`")
    missing = [
        f"{page.relative_to(ROOT)}: `{name}`"
        for page in pages
        for name in pattern.findall(page.read_text())
        if name not in READERS_FILES and not any((ROOT / (root + name)).exists() for root in PATH_ROOTS)
    ]
    assert not missing, "the docs name files that are not in the repository:\n" + "\n".join(missing)


def test_the_default_of_gradient_as_bucket_view_is_stated_as_the_signature_has_it():
    # issue 60: five places called `True` the default; the signature's default is None (views, DDP's arithmetic)
    import inspect

    from torchreplicate import replicate

    default = inspect.signature(replicate).parameters["gradient_as_bucket_view"].default
    assert default is None
    stale = re.compile(r"`gradient_as_bucket_view=True`,? \((?:our|the) default\)|which is our default|default `True`")
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    found = [f"{page.relative_to(ROOT)}: {m.group(0)}" for page in pages for m in stale.finditer(page.read_text())]
    assert not found, found


def test_the_api_page_shows_every_public_signature_as_the_code_has_it():
    # issue 60: the API page read as plain Markdown had no signature; the block is generated and checked here
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "api_signatures.py"), "--check"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    page = (ROOT / "docs" / "api.md").read_text()
    import torchreplicate

    for name in ("replicate", "verify_replicas", "ReplicateConfig", "ReplicateState", "log_summary", "trace"):
        assert f"def {name}(" in page or f"class {name}(" in page, name
    assert "bucket_layout: str = 'learned'" in page and "**ddp_arguments: Any" in page
    assert set(torchreplicate.__all__) >= {"replicate", "ReplicateState"}
    for member in ("config", "device", "reducer"):
        assert f"        - {member}\n" in page, f"ReplicateState's directive omits {member}"
