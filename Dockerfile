# syntax=docker/dockerfile:1
# One small image with every aaas binary (edge, lifecycle, sweeper, and
# dshsim for demos); each Deployment or compose service picks its command.
ARG GO_VERSION=1.26

FROM golang:${GO_VERSION}-bookworm AS build
WORKDIR /src
COPY go.mod go.sum ./
RUN --mount=type=cache,target=/go/pkg/mod go mod download
COPY . .
RUN --mount=type=cache,target=/go/pkg/mod --mount=type=cache,target=/root/.cache/go-build \
    CGO_ENABLED=0 go build -trimpath -ldflags="-s -w" -o /out/ \
      ./cmd/edge ./cmd/lifecycle ./cmd/sweeper ./cmd/dshsim

# Static binaries need no libc: distroless static, running as nonroot.
FROM gcr.io/distroless/static-debian12:nonroot
COPY --from=build /out/ /usr/local/bin/
USER nonroot:nonroot
EXPOSE 8080 9090
ENTRYPOINT ["/usr/local/bin/edge"]
