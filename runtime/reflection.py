"""gRPC server reflection under both of its names: ``grpc.reflection.v1.ServerReflection`` (what
current tools ask first) and the older ``grpc.reflection.v1alpha.ServerReflection``.

grpcio-reflection ships only v1alpha. The two protocols are the same messages with the same field
numbers in another package, so v1 is served by the one v1alpha servicer: its method path
``/grpc.reflection.v1.ServerReflection/ServerReflectionInfo`` is registered with v1alpha's
(de)serializers, which read and write v1's bytes unchanged. Both names are listed by
``list_services``; the v1 file (``grpc/reflection/v1/reflection.proto``, derived from v1alpha's
descriptor under the v1 package) sits in a private descriptor pool the servicer consults after
the process's own, so ``file_containing_symbol`` resolves the v1 service too and the process's
default pool stays untouched. Torch-free (the router serves it).
"""

from __future__ import annotations

from collections.abc import Iterable

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import reflection as v1alpha
from grpc_reflection.v1alpha import reflection_pb2 as v1alpha_pb2
from grpc_reflection.v1alpha import reflection_pb2_grpc as v1alpha_pb2_grpc

V1_PACKAGE = "grpc.reflection.v1"
V1_FILE = "grpc/reflection/v1/reflection.proto"
V1_SERVICE_NAME = f"{V1_PACKAGE}.ServerReflection"
V1ALPHA_SERVICE_NAME = v1alpha.SERVICE_NAME
SERVICE_NAMES = (V1_SERVICE_NAME, V1ALPHA_SERVICE_NAME)
METHOD = "ServerReflectionInfo"


def _rename_types(message: descriptor_pb2.DescriptorProto, old: str, new: str) -> None:
    for field in message.field:
        if field.type_name.startswith(old):
            field.type_name = new + field.type_name[len(old) :]
    for nested in message.nested_type:
        _rename_types(nested, old, new)


def v1_file_proto() -> descriptor_pb2.FileDescriptorProto:
    """``grpc/reflection/v1/reflection.proto``: v1alpha's file with the package (and every type
    reference into it) renamed; its language options are dropped (they name v1alpha)."""
    proto = descriptor_pb2.FileDescriptorProto()
    v1alpha_pb2.DESCRIPTOR.CopyToProto(proto)
    old, new = f".{proto.package}.", f".{V1_PACKAGE}."
    proto.name, proto.package = V1_FILE, V1_PACKAGE
    proto.ClearField("options")
    for message in proto.message_type:
        _rename_types(message, old, new)
    for service in proto.service:
        for method in service.method:
            method.input_type = method.input_type.replace(old, new, 1)
            method.output_type = method.output_type.replace(old, new, 1)
    return proto


_V1_POOL = descriptor_pool.DescriptorPool()
_V1_POOL.AddSerializedFile(v1_file_proto().SerializeToString())


class _Pools:
    """The look-ups the reflection servicer makes (DescriptorPool's method names), tried in each
    pool in turn (KeyError when none has the name)."""

    def __init__(self, *pools) -> None:
        self._pools = pools

    def _first(self, method: str, name: str):
        for pool in self._pools:
            try:
                return getattr(pool, method)(name)
            except KeyError:
                continue
        raise KeyError(name)

    def FindFileByName(self, name: str):
        return self._first("FindFileByName", name)

    def FindFileContainingSymbol(self, name: str):
        return self._first("FindFileContainingSymbol", name)

    def FindMessageTypeByName(self, name: str):
        return self._first("FindMessageTypeByName", name)

    # A message's extensions are looked up in the pool that holds the message.
    def FindExtensionByNumber(self, message, number: int):
        return message.file.pool.FindExtensionByNumber(message, number)

    def FindAllExtensions(self, message):
        return message.file.pool.FindAllExtensions(message)


def enable_reflection(
    service_names: Iterable[str], server, pool: descriptor_pool.DescriptorPool | None = None
) -> None:
    """Serve reflection v1 and v1alpha on ``server`` (grpc.aio or blocking), listing
    ``service_names`` and both reflection services; descriptors come from ``pool`` (default:
    the process's)."""
    names = tuple(dict.fromkeys((*service_names, *SERVICE_NAMES)))
    pools = _Pools(pool or descriptor_pool.Default(), _V1_POOL)
    if isinstance(server, grpc.aio.Server):
        servicer = v1alpha.aio.ReflectionServicer(names, pool=pools)
    else:
        servicer = v1alpha.ReflectionServicer(names, pool=pools)
    v1alpha_pb2_grpc.add_ServerReflectionServicer_to_server(servicer, server)
    v1_method = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=v1alpha_pb2.ServerReflectionRequest.FromString,
        response_serializer=v1alpha_pb2.ServerReflectionResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(V1_SERVICE_NAME, {METHOD: v1_method}),)
    )
