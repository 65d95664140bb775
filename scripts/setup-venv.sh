# Sourced by scripts/*.sh: creates .venv (if missing) and installs datapipe with the extras the
# tests and the demo need (synthetic: scikit-image's photographs for the demo's images). torch is pinned to 2.13.0 (a CPU build where one is available locally);
# constraints.txt pins every other package to a set known to work together, so pip never backtracks.
# Each step prints a line (and, on a terminal, pip its own progress). After a good install or check it writes a stamp
# keyed on setup.cfg, constraints.txt and this script: a rerun with those unchanged skips the slow import checks
# (remove .venv/.setup-ok-* to force them).
_setup_step() { echo "setup-venv: $*" >&2; }
_setup_pip_quiet=-q
[ -t 2 ] && _setup_pip_quiet=
if [ ! -x .venv/bin/python ]; then
  _setup_step "creating .venv"
  python3 -m venv .venv
fi
source .venv/bin/activate
_setup_stamp=".venv/.setup-ok-$(cat setup.cfg constraints.txt scripts/setup-venv.sh \
  | python -c 'import hashlib, sys; print(hashlib.sha256(sys.stdin.buffer.read()).hexdigest()[:16])')"
if [ -f "$_setup_stamp" ]; then
  _setup_step "installed, setup.cfg and constraints.txt unchanged: import checks skipped (rm $_setup_stamp to redo them)"
else
  _setup_step "checking the installed packages (torch, DALI, Ray, ...; ~30 s)"
  _setup_free_gb=$(df -Pk . | awk 'NR == 2 {print int($4 / 1048576)}')
  if [ -n "$_setup_free_gb" ] && [ "$_setup_free_gb" -lt 6 ]; then
    _setup_step "warning: ${_setup_free_gb} GB free on this disk; a fresh install takes ~4 GB (.venv) and pip's downloads more"
  fi
  if ! python -c "import torch, webdataset, nvidia.dali, pytest, s3fs, moto, ray, tokenizers, transformers, accelerate, lightning, skimage" >/dev/null 2>&1 \
     || ! python -c "import datapipe" >/dev/null 2>&1; then
    if ! { _setup_step "installing 1/3: pip" && python -m pip install -q --upgrade pip \
           && _setup_step "installing 2/3: torch 2.13.0 (the first time a download of several hundred MB)" \
           && python -m pip install $_setup_pip_quiet "torch==2.13.0" \
           && _setup_step "installing 3/3: datapipe with the extras test, dali, s3, ray, synthetic (constraints.txt)" \
           && python -m pip install $_setup_pip_quiet -c constraints.txt -e ".[test,dali,s3,ray,synthetic]"; }; then
      _setup_step "the install failed (pip's messages above say why; $(df -Ph . | awk 'NR == 2 {print $4}') free on this disk)"
      return 1 2>/dev/null || exit 1
    fi
  fi
  # The peers (bench rows only). litdata 0.2.76 imports with its own code and obstore beside the pins above, but
  # pip's resolver would pull torchvision and a CUDA torch for it: so --no-deps, kept only if it imports.
  # MosaicML Streaming 0.13 pins numpy<2.2 and transformers<5, which these pins do not meet, and imports torchvision,
  # which does not import beside this CPU torch 2.13 (tried with --no-deps: 'operator torchvision::nms does not
  # exist'): its rows skip here, saying why; the GPU host runs them.
  if ! python -c "import litdata" >/dev/null 2>&1; then
    _setup_step "installing litdata (optional: the peers' bench rows)"
    { python -m pip install -q --no-deps "litdata==0.2.76" "obstore==0.12.1" && python -c "import litdata" >/dev/null 2>&1; } \
      || python -m pip uninstall -q -y litdata obstore >/dev/null 2>&1 || true
  fi
  # SPDL, Grain and Megatron-Energon install beside the pins (constraints.txt pins what they pull in). A failure
  # leaves their bench rows reported as not installed; it never fails the setup.
  if ! python -c "import spdl.dataloader, grain, megatron.energon" >/dev/null 2>&1; then
    _setup_step "installing SPDL, Grain and Megatron-Energon (optional: the peers' bench rows)"
    python -m pip install -q -c constraints.txt "spdl==0.8.0" "grain==0.2.18" "megatron-energon==7.4.1" \
      >/dev/null 2>&1 || _setup_step "SPDL, Grain or Energon did not install: their bench rows say not installed"
  fi
  rm -f .venv/.setup-ok-*
  touch "$_setup_stamp"
  _setup_step "ready"
fi
