// A skeleton tool-use environment in TypeScript: a vcpo.v1.Environment server with the gRPC health service the
// sampler checks, an optional bearer token and optional TLS. Copy it and replace the game.
//
// The handlers are typed by stubs that proto-loader-gen-types makes from the repository's protos; the protos
// themselves are loaded at start-up, with the options the types were generated with (docs/environments/
// typescript.md):
//
//     npm ci && npm run build
//     node dist/guess_env.js --port 50070 [--max-calls 8] [--token-file FILE] [--tls-cert PEM --tls-key PEM]
//
// The game: the task hides a whole number (its payload_json {"target": 37}, else one derived from its task_id,
// 1 to 100) and the model calls the `guess` tool with {"number": 50} (register it with the `json` tool parser).
// Each answer says "higher", "lower" or "correct"; a correct guess ends the episode with reward 1 (register it
// with the scorer "environment"), and so does, with reward 0, the --max-calls-th guess. A mistake of the model
// (another tool, arguments that are not {"number": <whole number>}) is answered with an observation saying what
// was wrong, never with an error status: that would fail the whole group. examples/go/main.go is the same
// server in Go.
import { timingSafeEqual } from 'node:crypto';
import * as fs from 'node:fs';
import * as path from 'node:path';
import { parseArgs } from 'node:util';

import * as grpc from '@grpc/grpc-js';
import * as protoLoader from '@grpc/proto-loader';
import { HealthImplementation } from 'grpc-health-check';

import type { ProtoGrpcType } from './generated/environment';
import type { Action__Output } from './generated/vcpo/v1/Action';
import type { EnvironmentHandlers } from './generated/vcpo/v1/Environment';
import type { StepResponse } from './generated/vcpo/v1/StepResponse';
import type { Task__Output } from './generated/vcpo/v1/Task';
import type { ToolSchema } from './generated/vcpo/v1/ToolSchema';

const SERVICE = 'vcpo.v1.Environment';
const PROTOS = path.resolve(__dirname, '..', '..', '..', 'protos'); // from dist/ to the repository's protos/
// the options of package.json's "generate" script: the types describe what this loader produces
const LOADER_OPTIONS: protoLoader.Options = {
  keepCase: true, // field names as in the .proto files: session_id, arguments_json
  longs: String, // 64-bit integers as decimal strings (the environment's own messages have none)
  enums: String,
  defaults: true,
  oneofs: true,
  includeDirs: [PROTOS],
};

const GUESS_TOOL: ToolSchema = {
  name: 'guess',
  description: 'Guess the hidden whole number; the answer says higher, lower or correct.',
  parameters_json_schema:
    '{"type": "object", "properties": {"number": {"type": "integer"}}, "required": ["number"]}',
};

interface Session {
  target: number;
  calls: number;
}

class BadTask extends Error {}

function fnv1a(text: string): number {
  // 32-bit FNV-1a of the UTF-8 bytes: the Go skeleton's hash/fnv, so both pick the same number
  let hash = 0x811c9dc5;
  for (const byte of Buffer.from(text, 'utf8')) {
    hash = Math.imul(hash ^ byte, 0x01000193) >>> 0;
  }
  return hash;
}

function targetOf(task: Task__Output | null): number {
  // the hidden number: payload_json {"target": n}, else one from the task id
  const taskId = task?.task_id ?? '';
  if (!task?.payload_json) return (fnv1a(taskId) % 100) + 1;
  let payload: unknown;
  try {
    payload = JSON.parse(task.payload_json);
  } catch {
    payload = null;
  }
  const target = (payload as { target?: unknown } | null)?.target;
  if (!Number.isSafeInteger(target)) {
    throw new BadTask(`task ${JSON.stringify(taskId)}: payload_json must be {"target": <whole number>}`);
  }
  return target as number;
}

function answer(action: Action__Output | null, target: number): [string, boolean] {
  // the observation for one call, and whether it found the number
  const tool = action?.tool_name ?? '';
  if (tool === '') {
    return [
      'error: no tool call could be read; call it as ' +
        '<tool_call>{"name": "guess", "arguments": {"number": 50}}</tool_call>',
      false,
    ];
  }
  if (tool !== GUESS_TOOL.name) {
    return [`error: unknown tool ${JSON.stringify(tool)}; the tool is "guess"`, false];
  }
  let number: unknown;
  try {
    number = (JSON.parse(action?.arguments_json ?? '') as { number?: unknown } | null)?.number;
  } catch {
    number = undefined;
  }
  if (!Number.isSafeInteger(number)) return ['error: the arguments must be {"number": <whole number>}', false];
  if ((number as number) < target) return ['higher', false];
  if ((number as number) > target) return ['lower', false];
  return ['correct', true];
}

function guessGame(maxCalls: number): EnvironmentHandlers {
  // each episode's state by session id: the sampler runs many sessions at once, the calls of one session come
  // one at a time (and Node runs one handler at a time, so the map needs no lock)
  const sessions = new Map<string, Session>();
  return {
    Reset(call, callback) {
      let target: number;
      try {
        target = targetOf(call.request.task);
      } catch (err) {
        // a task this environment cannot play is the submitter's mistake, not the model's: fail the group
        callback({ code: grpc.status.INVALID_ARGUMENT, details: (err as Error).message });
        return;
      }
      sessions.set(call.request.session_id, { target, calls: 0 });
      callback(null, { tools: [GUESS_TOOL] });
    },
    Step(call, callback) {
      // a tool that takes a while should give up by call.getDeadline(): the sampler's deadline
      const session = sessions.get(call.request.session_id);
      if (session === undefined) {
        callback({
          code: grpc.status.NOT_FOUND,
          details: `unknown session ${JSON.stringify(call.request.session_id)}`,
        });
        return;
      }
      session.calls += 1;
      const [text, solved] = answer(call.request.action, session.target);
      const reply: StepResponse = {
        observation: { text },
        reward: solved ? 1 : 0,
        done: solved || session.calls >= maxCalls,
      };
      callback(null, reply);
    },
    Close(call, callback) {
      // Close may name a session whose Reset failed or never came: nothing to drop is not an error
      sessions.delete(call.request.session_id);
      callback(null, {});
    },
  };
}

function requireToken(handlers: EnvironmentHandlers, token: string): EnvironmentHandlers {
  // refuse calls without "authorization: Bearer <token>" metadata; health (served apart) stays open, and the
  // sampler sends the token there too
  const want = Buffer.from(`Bearer ${token}`);
  const allowed = (metadata: grpc.Metadata): boolean => {
    const sent = metadata.get('authorization');
    if (sent.length !== 1) return false;
    const got = Buffer.from(String(sent[0]));
    return got.length === want.length && timingSafeEqual(got, want);
  };
  const refuse = { code: grpc.status.UNAUTHENTICATED, details: 'no authorization metadata or a wrong token' };
  return {
    Reset: (call, callback) => (allowed(call.metadata) ? handlers.Reset(call, callback) : callback(refuse)),
    Step: (call, callback) => (allowed(call.metadata) ? handlers.Step(call, callback) : callback(refuse)),
    Close: (call, callback) => (allowed(call.metadata) ? handlers.Close(call, callback) : callback(refuse)),
  };
}

function fail(message: string): never {
  console.error(`guess_env: ${message}`);
  process.exit(1);
}

function flags() {
  const { values } = parseArgs({
    options: {
      host: { type: 'string', default: '127.0.0.1' },
      port: { type: 'string', default: '50070' },
      'max-calls': { type: 'string', default: '8' },
      'token-file': { type: 'string', default: '' },
      'tls-cert': { type: 'string', default: '' },
      'tls-key': { type: 'string', default: '' },
    },
  });
  for (const name of ['port', 'max-calls'] as const) {
    if (!/^\d+$/.test(values[name])) fail(`--${name} must be a whole number, got ${JSON.stringify(values[name])}`);
  }
  if (!values['tls-cert'] !== !values['tls-key']) fail('--tls-cert and --tls-key go together');
  return values;
}

function main(): void {
  const args = flags();
  const definition = protoLoader.loadSync('vcpo/v1/environment.proto', LOADER_OPTIONS);
  const proto = grpc.loadPackageDefinition(definition) as unknown as ProtoGrpcType;
  let handlers = guessGame(Number(args['max-calls']));
  if (args['token-file']) {
    const token = fs.readFileSync(args['token-file'], 'utf8').trim();
    if (!token) fail(`--token-file ${args['token-file']}: no token in it`);
    handlers = requireToken(handlers, token);
  }
  const credentials = args['tls-cert']
    ? grpc.ServerCredentials.createSsl(null, [
        { cert_chain: fs.readFileSync(args['tls-cert']), private_key: fs.readFileSync(args['tls-key']) },
      ])
    : grpc.ServerCredentials.createInsecure();

  const server = new grpc.Server();
  server.addService(proto.vcpo.v1.Environment.service, handlers);
  // the sampler checks health when the environment is registered: SERVING for the service and the server
  const health = new HealthImplementation({ '': 'SERVING', [SERVICE]: 'SERVING' });
  health.addToServer(server);
  const address = `${args.host}:${args.port}`;
  server.bindAsync(address, credentials, (err, port) => {
    if (err) fail(`cannot listen on ${address}: ${err.message}`);
    console.log(`listening on ${args.host}:${port}`);
  });
  const stop = () => {
    health.setStatus('', 'NOT_SERVING');
    health.setStatus(SERVICE, 'NOT_SERVING');
    const force = setTimeout(() => server.forceShutdown(), 2000); // the calls in flight get 2 s
    server.tryShutdown(() => clearTimeout(force));
  };
  process.on('SIGINT', stop);
  process.on('SIGTERM', stop);
}

main();
