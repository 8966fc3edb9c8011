# npuprobe's container image: a static binary on a distroless base.
#
#   docker build -t npuprobe .
#   docker build --build-arg VERSION=$(git describe --always --dirty) -t npuprobe .
#   docker buildx build --platform linux/arm64,linux/amd64 -t REGISTRY/npuprobe:TAG --push .
#
# Both base images are build arguments, so the image can be built where no
# registry is reachable, from bases made locally (tests/container does this):
# GO_IMAGE needs Go (the version go.mod asks for) and a POSIX shell,
# RUNTIME_IMAGE can be anything, even scratch: the binary is static and needs
# no file from the image. Modules come from vendor/ when the build context
# has one (`go mod vendor`): the build then needs no network at all;
# otherwise they are downloaded from the Go module proxy.
#
# Run it as README.md says ("Running in a container"): privileged, or with
# the capabilities listed there, in the host's PID namespace.

ARG GO_IMAGE=golang:1.26-bookworm
ARG RUNTIME_IMAGE=gcr.io/distroless/static-debian12

# The builder runs on the target platform (buildx --platform emulates it
# when it is not the build machine's), so Go builds natively for it. The BPF
# objects for amd64 and arm64 are committed in bpf/: no clang needed.
FROM ${GO_IMAGE} AS build
WORKDIR /src
# GOTOOLCHAIN=local: build with the image's Go, never download another one.
ENV CGO_ENABLED=0 GOTOOLCHAIN=local
COPY . .
ARG VERSION=dev
# go build takes the modules from vendor/ when vendor/modules.txt exists
# (Go's default for a go.mod at go 1.14 or later), else from the proxy.
# Its caches live and die in this step, so that the layer is the binary.
RUN set -eu; \
    if [ -f vendor/modules.txt ]; then \
        echo "npuprobe: building with the vendored modules (no network needed)"; \
    fi; \
    export GOCACHE=/tmp/go/cache GOMODCACHE=/tmp/go/mod; \
    go build -trimpath \
        -ldflags "-s -w -X main.version=${VERSION}" \
        -o /out/npuprobe ./cmd/npuprobe; \
    go clean -cache -modcache

FROM ${RUNTIME_IMAGE}
COPY --from=build /out/npuprobe /usr/local/bin/npuprobe
# Root, numerically (the runtime image may have no /etc/passwd): loading and
# attaching eBPF programs, reading other processes' /proc entries and
# signalling them need root's capabilities (see README.md).
USER 0:0
# Snapshots go to the working directory unless --out says otherwise; mount
# a volume here (the Kubernetes DaemonSet mounts a host path).
WORKDIR /var/lib/npuprobe
ENTRYPOINT ["/usr/local/bin/npuprobe"]
CMD ["--help"]
