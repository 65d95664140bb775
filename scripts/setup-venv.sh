# Sourced by scripts/*.sh: creates .venv (if missing) and installs datapipe with the extras the
# tests and the demo need (synthetic: scikit-image's photographs for the demo's images). torch is pinned to 2.13.0 (a CPU build where one is available locally);
# constraints.txt pins every other package to a set known to work together, so pip never backtracks.
python3 -m venv .venv
source .venv/bin/activate
if ! python -c "import torch, webdataset, nvidia.dali, pytest, s3fs, moto, ray, tokenizers, transformers, accelerate, lightning, skimage" >/dev/null 2>&1 \
   || ! python -c "import datapipe" >/dev/null 2>&1; then
  python -m pip install -q --upgrade pip
  python -m pip install -q "torch==2.13.0"
  python -m pip install -q -c constraints.txt -e ".[test,dali,s3,ray,synthetic]"
fi
# The peers (bench rows only). litdata 0.2.76 imports with its own code and obstore beside the pins above, but
# pip's resolver would pull torchvision and a CUDA torch for it: so --no-deps, kept only if it imports.
# MosaicML Streaming 0.13 pins numpy<2.2 and transformers<5, which these pins do not meet: its rows skip.
if ! python -c "import litdata" >/dev/null 2>&1; then
  { python -m pip install -q --no-deps "litdata==0.2.76" "obstore==0.12.1" && python -c "import litdata" >/dev/null 2>&1; } \
    || python -m pip uninstall -q -y litdata obstore >/dev/null 2>&1 || true
fi
