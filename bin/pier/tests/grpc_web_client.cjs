// A real gRPC-web client for bin/pier/tests/grpc.rs: Connect's gRPC-web
// transport (@connectrpc/connect-web, binary format, over node's fetch, so
// HTTP/1.1) calling grpc-go's interop TestService through Pier.
//
//   node grpc_web_client.cjs MODULES_DIR BASE_URL
//
// MODULES_DIR holds node_modules with @connectrpc/connect, @connectrpc/connect-web
// and @bufbuild/protobuf (.ci/run installs them). The service is described at
// run time (a FileDescriptorProto built here, no code generation): the subset
// of grpc.testing's messages these calls use. Prints one line per check and
// exits 1 on the first mismatch.
"use strict";
const path = require("path");
const { createRequire } = require("module");

const [modules, baseUrl] = process.argv.slice(2);
const req = createRequire(path.join(modules, "index.js"));
const { create, createFileRegistry } = req("@bufbuild/protobuf");
const { FileDescriptorProtoSchema } = req("@bufbuild/protobuf/wkt");
const { createClient, ConnectError, Code } = req("@connectrpc/connect");
const { createGrpcWebTransport } = req("@connectrpc/connect-web");

// FieldDescriptorProto types and labels.
const INT32 = 5, STRING = 9, MESSAGE = 11, BYTES = 12;
const OPTIONAL = 1, REPEATED = 3;
const f = (name, number, type, typeName, label = OPTIONAL) =>
  ({ name, number, type, label, ...(typeName ? { typeName } : {}), jsonName: name });

const file = create(FileDescriptorProtoSchema, {
  name: "pier_grpc_web_test.proto",
  package: "grpc.testing",
  syntax: "proto3",
  messageType: [
    // PayloadType is an enum in the real proto; an int32 is the same varint.
    { name: "Payload", field: [f("type", 1, INT32), f("body", 2, BYTES)] },
    { name: "EchoStatus", field: [f("code", 1, INT32), f("message", 2, STRING)] },
    {
      name: "SimpleRequest",
      field: [
        f("response_type", 1, INT32),
        f("response_size", 2, INT32),
        f("payload", 3, MESSAGE, ".grpc.testing.Payload"),
        f("response_status", 7, MESSAGE, ".grpc.testing.EchoStatus"),
      ],
    },
    { name: "SimpleResponse", field: [f("payload", 1, MESSAGE, ".grpc.testing.Payload")] },
    { name: "ResponseParameters", field: [f("size", 1, INT32), f("interval_us", 2, INT32)] },
    {
      name: "StreamingOutputCallRequest",
      field: [
        f("response_type", 1, INT32),
        f("response_parameters", 2, MESSAGE, ".grpc.testing.ResponseParameters", REPEATED),
        f("payload", 3, MESSAGE, ".grpc.testing.Payload"),
      ],
    },
    {
      name: "StreamingOutputCallResponse",
      field: [f("payload", 1, MESSAGE, ".grpc.testing.Payload")],
    },
  ],
  service: [
    {
      name: "TestService",
      method: [
        { name: "UnaryCall", inputType: ".grpc.testing.SimpleRequest", outputType: ".grpc.testing.SimpleResponse" },
        {
          name: "StreamingOutputCall",
          inputType: ".grpc.testing.StreamingOutputCallRequest",
          outputType: ".grpc.testing.StreamingOutputCallResponse",
          serverStreaming: true,
        },
      ],
    },
  ],
});
const registry = createFileRegistry(file, () => undefined);
const service = registry.getService("grpc.testing.TestService");

function fail(msg) {
  console.log("FAIL " + msg);
  process.exit(1);
}

async function main() {
  const transport = createGrpcWebTransport({ baseUrl, useBinaryFormat: true });
  const client = createClient(service, transport);

  // Unary: 1,000 bytes asked for, 314 sent.
  const r = await client.unaryCall({ responseSize: 1000, payload: { body: new Uint8Array(314) } });
  if (!r.payload || r.payload.body.length !== 1000) fail(`unary: ${r.payload && r.payload.body.length} bytes`);
  console.log("ok unary 1000 bytes");

  // Server streaming: four messages of the sizes asked for, in order.
  const sizes = [31415, 9, 2653, 58979];
  const got = [];
  for await (const m of client.streamingOutputCall({ responseParameters: sizes.map((size) => ({ size })) })) {
    got.push(m.payload.body.length);
  }
  if (JSON.stringify(got) !== JSON.stringify(sizes)) fail(`server streaming: ${JSON.stringify(got)}`);
  console.log("ok server streaming " + got.join(","));

  // An error the server sends as trailers only: status and message reach the client.
  try {
    await client.unaryCall({ responseStatus: { code: 3, message: "pier says no" } });
    fail("error call succeeded");
  } catch (e) {
    const ce = ConnectError.from(e);
    if (ce.code !== Code.InvalidArgument || ce.rawMessage !== "pier says no") {
      fail(`error call: code ${ce.code}, message ${JSON.stringify(ce.rawMessage)}`);
    }
    console.log("ok error INVALID_ARGUMENT 'pier says no'");
  }
}

main().catch((e) => fail(String(e && e.stack || e)));
