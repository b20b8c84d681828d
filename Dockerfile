# swarmtrain's image: every service of docker-compose.yml runs it (coordinator, NAT routers,
# volunteers). CPU only: the embedded default run needs no GPU and downloads nothing at run time.
FROM python:3.11-slim-bookworm

# gcc and libgmp-dev: libp2p's fastecdsa builds from source. iproute2: the entrypoint's default
# route. nftables: the NAT routers.
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libgmp-dev iproute2 nftables \
    && rm -rf /var/lib/apt/lists/*

# torch first, from the CPU index: resolved from PyPI it pulls gigabytes of CUDA wheels.
RUN pip install --no-cache-dir torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu

WORKDIR /src
COPY pyproject.toml README.md ./
COPY p2p ./p2p
COPY swarm ./swarm
COPY diloco ./diloco
COPY verify ./verify
COPY swarmtrain ./swarmtrain
RUN pip install --no-cache-dir . && swarmtrain --help > /dev/null

COPY docker/entrypoint.sh /usr/local/bin/swarmtrain-entrypoint
COPY docker/nat-router.sh /usr/local/bin/nat-router

ENV PYTHONUNBUFFERED=1
# Commands in docker-compose.yml use paths relative to this directory; volumes mount under it.
WORKDIR /swarm
ENTRYPOINT ["swarmtrain-entrypoint"]
CMD ["swarmtrain", "--help"]
