# gpumesh in a container. The image runs a coordinator by default; the same image is a worker
# with `join tcp://HOST:8732` (see docker-compose.yaml and README.md "Docker").
#
#   docker build -t gpumesh:local .
#   export GPUMESH_TOKEN=$(docker run --rm gpumesh:local token)
#   docker run -d --init -e GPUMESH_TOKEN -p 127.0.0.1:8732:8732 -v gpumesh-data:/data gpumesh:local
# (--init: a task's stray child processes are reaped by an init, not left to gpumesh as PID 1.)
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# Extras to install with it, e.g. --build-arg GPUMESH_EXTRAS=gpu: a worker finds GPUs through
# torch, which the default image leaves out (a CUDA build is gigabytes).
ARG GPUMESH_EXTRAS=""
COPY . /tmp/gpumesh
RUN pip install "/tmp/gpumesh${GPUMESH_EXTRAS:+[$GPUMESH_EXTRAS]}" && rm -rf /tmp/gpumesh

# A worker runs the code it is sent as the user who started it: never root. /data is created
# owned by that user and 0700, as gpumesh wants its home; a new named volume copies both.
RUN useradd --create-home --uid 10001 --user-group gpumesh \
    && install -d -o gpumesh -g gpumesh -m 0700 /data

# /data holds the journal (coordinator-PORT.db) and worker identities. LAN discovery is off:
# zeroconf's multicast stays inside Docker's bridge network, and would advertise the container's
# bridge address, which no other machine can dial. Workers in containers are given the URL.
ENV GPUMESH_HOME=/data \
    GPUMESH_DISCOVERY=0
VOLUME ["/data"]
USER gpumesh
WORKDIR /home/gpumesh

# 8732, not the host default 8000, so that published docker and compose recipes stay stable.
EXPOSE 8732

# Healthy means the coordinator answers a CURVE handshake made with this container's
# GPUMESH_TOKEN, not merely that the port is open. It is the coordinator's check: a worker
# container (`join ...`) turns it off (compose: healthcheck: disable; docker run --no-healthcheck).
# Every 30 s: with --no-save no derived key is cached, and a token not made by `gpumesh token`
# (the spec's `secrets.token_urlsafe(32)`) costs each check an scrypt: 0.4 s of CPU, 128 MiB.
HEALTHCHECK --interval=30s --timeout=10s --start-period=30s --retries=3 \
    CMD ["gpumesh", "status", "--url", "tcp://127.0.0.1:8732"]

ENTRYPOINT ["gpumesh"]
# Bind 0.0.0.0 inside the container: traffic arrives through Docker's published port, so a
# loopback bind would answer nothing. Who can reach it is decided by the publish address (-p).
# --no-save: the token stays in the environment instead of being written onto the volume.
CMD ["serve", "--host", "0.0.0.0", "--port", "8732", "--no-save"]
