# The smallest CUDA image that works: the torch wheel brings its own CUDA libraries (cuBLAS, cuDNN,
# NCCL) and Triton ships its own ptxas, so "base" (driver hookup for --gpus) is enough; "devel" would add
# several GB of toolkit we never call. What Triton does need at run time is a C compiler and Python's
# headers, to build the small launcher it compiles for each kernel.
# Pinned by digest, so that a rebuild starts from the same bytes; the digest is the tag's linux/amd64 image (not
# its multi-platform index), hence the platform named beside it.
# hadolint ignore=DL3029
FROM --platform=linux/amd64 nvidia/cuda:12.8.1-base-ubuntu24.04@sha256:e711c99333fdfe8ae1e677b4972be6c5021f0128a1d31f775c7e58d88921b6a9

# Versions are left to the Ubuntu 24.04 release that the image tag fixes: the archive drops old point
# releases, so exact pins would break the build within weeks.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev python3 python3-dev python3-venv \
    && rm -rf /var/lib/apt/lists/*

# Ubuntu 24.04's Python refuses system-wide pip installs (PEP 668), so everything goes into a venv.
ENV VIRTUAL_ENV=/opt/venv
RUN python3 -m venv "$VIRTUAL_ENV"
ENV PATH="$VIRTUAL_ENV/bin:$PATH"

# The torch the project is tested with on GPU (2.11), in its CUDA 12.8 build to match the base image; it brings
# the Triton it was built with (3.6.0).
RUN pip install --no-cache-dir torch==2.11.0 --index-url https://download.pytorch.org/whl/cu128

# The code runs from this folder, where a run also writes (logs/, the downloaded shards under data/): it belongs to
# ubuntu (uid 1000), the image's non-root user. .git's HEAD and branch refs come along (.dockerignore), so that the
# versions line of each run's log names the commit the image was built from, without git in the image.
WORKDIR /workspace/gpt-speedrun
COPY --chown=1000:1000 . .
RUN pip install --no-cache-dir . && chown 1000:1000 .
USER 1000:1000

CMD ["bash", "run.sh"]
