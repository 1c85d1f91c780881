# syntax=docker/dockerfile:1
# The aaas image: edge, lifecycle, sweeper and setup, static, on distroless,
# running as the numeric user 65532 (distroless's nonroot: the kubelet can
# only verify runAsNonRoot against a numeric user). Each Deployment or
# compose service picks its command. `--target dshsim` builds the DSH Web
# stand-in for demos instead. hack/image builds the same images without
# Docker; a test keeps the two in step.
ARG GO_VERSION=1.26

FROM golang:${GO_VERSION}-bookworm AS build
WORKDIR /src
COPY go.mod go.sum ./
RUN --mount=type=cache,target=/go/pkg/mod go mod download
COPY . .
# The release the binaries report: docker build --build-arg VERSION=$(git describe --tags --always)
ARG VERSION=dev
RUN --mount=type=cache,target=/go/pkg/mod --mount=type=cache,target=/root/.cache/go-build \
    CGO_ENABLED=0 go build -trimpath -ldflags="-s -w -X github.com/aaas-project/aaas/internal/telemetry.Version=${VERSION}" -o /out/ \
      ./cmd/edge ./cmd/lifecycle ./cmd/sweeper ./cmd/setup ./cmd/dshsim

FROM gcr.io/distroless/static-debian12:nonroot AS dshsim
COPY --from=build /out/dshsim /usr/local/bin/dshsim
USER 65532:65532
EXPOSE 3080
ENTRYPOINT ["/usr/local/bin/dshsim"]

FROM gcr.io/distroless/static-debian12:nonroot
ARG VERSION=dev
LABEL org.opencontainers.image.title="aaas" \
      org.opencontainers.image.source="https://github.com/aaas-project/aaas" \
      org.opencontainers.image.version="${VERSION}"
COPY --from=build /out/edge /out/lifecycle /out/sweeper /out/setup /usr/local/bin/
USER 65532:65532
EXPOSE 8080 9090
ENTRYPOINT ["/usr/local/bin/edge"]
