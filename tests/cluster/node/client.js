// A Node client of the splitserve router that knows nothing but the .proto files: they are loaded
// at run time with @grpc/proto-loader (no generated code). tests/cluster/test_node_client.py runs
// it and compares what it prints with the Python SDK's answers.
//
//   node client.js ADDRESS PROTO_ROOT
//
// Prints one JSON object: for each request (token ids, text, chat) the unary Complete answer and
// the server-streamed Generate messages, plus the status of an invalid request.
'use strict';

const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');

const [address, protoRoot] = process.argv.slice(2);
if (!address || !protoRoot) {
  console.error('usage: node client.js ADDRESS PROTO_ROOT');
  process.exit(2);
}

const definition = protoLoader.loadSync('splitserve/v1/router.proto', {
  includeDirs: [protoRoot],
  keepCase: true, // field names as in the .proto (token_ids, finish_reason)
  longs: Number, // uint64/int64 as numbers; uint32 ids are plain numbers anyway
  enums: String,
  defaults: true, // unset repeated fields as [] and scalars as their zero value
  oneofs: true, // the set member of `oneof prompt` is named in request.prompt
});
const v1 = grpc.loadPackageDefinition(definition).splitserve.v1;
const router = new v1.RouterService(address, grpc.credentials.createInsecure());

const deadline = () => new Date(Date.now() + 60000);
const GREEDY = { temperature: 0, max_tokens: 8 };

function complete(request) {
  return new Promise((resolve, reject) => {
    router.Complete(request, { deadline: deadline() }, (err, reply) =>
      err ? reject(err) : resolve(reply),
    );
  });
}

function generate(request) {
  return new Promise((resolve, reject) => {
    const messages = [];
    const call = router.Generate(request, { deadline: deadline() });
    call.on('data', (msg) => messages.push(msg));
    call.on('error', reject);
    call.on('end', () => resolve(messages));
  });
}

const plain = (msg) => ({
  text: msg.text,
  token_ids: msg.token_ids,
  finish_reason: msg.finish_reason,
  usage: msg.usage ? { completion_tokens: msg.usage.completion_tokens } : null,
});

async function both(request) {
  const unary = await complete(request);
  const stream = await generate(request);
  return { complete: plain(unary), generate: stream.map(plain) };
}

async function statusOf(request) {
  try {
    await complete(request);
    return { code: 0 };
  } catch (err) {
    return { code: err.code, details: err.details };
  }
}

async function main() {
  const out = {
    token_ids: await both({ token_ids: { ids: [1, 2, 3, 4, 5] }, sampling: GREEDY }),
    text: await both({ text: 'Hello', sampling: GREEDY }),
    chat: await both({
      messages: { messages: [{ role: 'user', content: 'Hi' }] },
      sampling: GREEDY,
    }),
    invalid: await statusOf({ text: 'Hello', sampling: { temperature: 0, max_tokens: 0 } }),
  };
  router.close();
  process.stdout.write(JSON.stringify(out) + '\n');
}

main().catch((err) => {
  console.error(err && err.stack ? err.stack : err);
  process.exit(1);
});
