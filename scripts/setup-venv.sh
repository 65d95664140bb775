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
# The peers extra (litdata, MosaicML Streaming: bench rows only) goes in only where it installs beside
# torch 2.13 and the pins above (today mosaicml-streaming 0.13 wants numpy<2.2 and transformers<5, so
# pip refuses and it is skipped), and only if it then imports; otherwise it is taken out again.
if ! python -c "import litdata, streaming" >/dev/null 2>&1 \
   && python -m pip install -q --dry-run -c constraints.txt "torch==2.13.0" -e ".[peers]" >/dev/null 2>&1; then
  python -m pip install -q -c constraints.txt "torch==2.13.0" -e ".[peers]" \
    && python -c "import litdata, streaming" >/dev/null 2>&1 \
    || python -m pip uninstall -q -y litdata mosaicml-streaming
fi
