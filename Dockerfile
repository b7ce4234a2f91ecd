# The smallest CUDA image that works: the torch wheel brings its own CUDA libraries (cuBLAS, cuDNN,
# NCCL) and Triton ships its own ptxas, so "base" (driver hookup for --gpus) is enough; "devel" would add
# several GB of toolkit we never call. What Triton does need at run time is a C compiler and Python's
# headers, to build the small launcher it compiles for each kernel.
FROM nvidia/cuda:12.8.1-base-ubuntu24.04

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

# The torch the project is tested with on GPU (2.11), in its CUDA 12.8 build to match the base image.
RUN pip install --no-cache-dir torch==2.11.0 --index-url https://download.pytorch.org/whl/cu128

WORKDIR /workspace/gpt-speedrun
COPY . .
RUN pip install --no-cache-dir .

CMD ["bash", "run.sh"]
