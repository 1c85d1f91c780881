# syntax=docker/dockerfile:1
# The aaas image: edge, lifecycle, sweeper, broker and setup, static, on distroless,
# running as the numeric user 65532 (distroless's nonroot: the kubelet can
# only verify runAsNonRoot against a numeric user). Each Deployment or
# compose service picks its command. `--target dshsim` builds the DSH Web
# stand-in for demos instead, with the model provider stand-in beside it. hack/image builds the same images without
# Docker; a test keeps the two in step. Base images are pinned by digest
# (the tag says which release it is): a rebuild gets the same bytes, and a
# moved tag cannot change the image (versions_test.go checks every FROM).
# To update: crane digest golang:1.26.8-bookworm, and the same for
# gcr.io/distroless/static-debian12:nonroot (both of its FROMs).

FROM golang:1.26.8-bookworm@sha256:a688600ca24f8a4d3ca77f95b0dd40704a9fc787c826660eb7ba0b641b8b175d AS build
WORKDIR /src
COPY go.mod go.sum ./
RUN --mount=type=cache,target=/go/pkg/mod go mod download
COPY . .
# The release the binaries report: docker build --build-arg VERSION=$(git describe --tags --always)
ARG VERSION=dev
RUN --mount=type=cache,target=/go/pkg/mod --mount=type=cache,target=/root/.cache/go-build \
    CGO_ENABLED=0 go build -trimpath -ldflags="-s -w -X github.com/aaas-project/aaas/internal/telemetry.Version=${VERSION}" -o /out/ \
      ./cmd/edge ./cmd/lifecycle ./cmd/sweeper ./cmd/broker ./cmd/setup ./internal/dev/cmd/dshsim ./internal/dev/cmd/providersim

FROM gcr.io/distroless/static-debian12:nonroot@sha256:afa5c872c891853ca7fcf1f12c3edb23f7eeef36189728842dd51042ff57f7ab AS dshsim
ARG VERSION=dev
# What the stand-in reports as its version (/api/echo), as hack/image sets it.
ENV DSHSIM_VERSION=${VERSION}
COPY --from=build /out/dshsim /out/providersim /usr/local/bin/
USER 65532:65532
EXPOSE 3080
ENTRYPOINT ["/usr/local/bin/dshsim"]

FROM gcr.io/distroless/static-debian12:nonroot@sha256:afa5c872c891853ca7fcf1f12c3edb23f7eeef36189728842dd51042ff57f7ab
ARG VERSION=dev
LABEL org.opencontainers.image.title="aaas" \
      org.opencontainers.image.source="https://github.com/aaas-project/aaas" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0"
COPY --from=build /out/edge /out/lifecycle /out/sweeper /out/broker /out/setup /usr/local/bin/
USER 65532:65532
EXPOSE 8080 9090
ENTRYPOINT ["/usr/local/bin/edge"]
