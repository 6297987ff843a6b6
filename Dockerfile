# syntax=docker/dockerfile:1
# tongs' container image. From the repository root:
#   docker build -t tongs:0.1.0 .
# The Kubernetes manifests in deploy/ run it with the configuration mounted at /etc/tongs/tongs.yaml.

FROM rust:1-bookworm AS build
WORKDIR /src
COPY . .
# The cache mounts keep crates and compiled dependencies between builds (BuildKit); the binary is copied
# out of the cached target directory in the same step.
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/usr/local/cargo/git \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked --bin tongs \
    && cp target/release/tongs /tongs

# glibc and libgcc only, no shell, no package manager; runs as the distroless `nonroot` user. TLS needs no
# system CA bundle: tongs trusts the webpki roots compiled into it (plus upstream.extra_ca_file).
FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=build /tongs /tongs
# A default configuration, so `docker run` works on its own; in Kubernetes the ConfigMap mounted at
# /etc/tongs replaces it.
COPY config/tongs.yaml /etc/tongs/tongs.yaml
USER 65532:65532
# 8080: client traffic (listen); 9090: /healthz, /readyz, /metrics, /demand (admin.listen).
EXPOSE 8080 9090
ENTRYPOINT ["/tongs"]
CMD ["run", "--config", "/etc/tongs/tongs.yaml"]
