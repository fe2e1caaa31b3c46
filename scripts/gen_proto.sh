#!/usr/bin/env bash
# Regenerate the Python protobuf/gRPC modules from src/ddiloco/runtime/proto/ddiloco.proto.
# Needs grpcio-tools (pip install -e '.[test]'). The generated files are committed, so users
# never need grpcio-tools; rerun this after any change to the .proto file.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m grpc_tools.protoc \
    -I src \
    --python_out=src --pyi_out=src --grpc_python_out=src \
    src/ddiloco/runtime/proto/ddiloco.proto
