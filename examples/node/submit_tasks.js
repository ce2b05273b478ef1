// A client of a running system in Node.js: register a custom environment, submit tasks for it, watch its
// status (examples/submit_tasks.py in another language: the same flags, lines and exit codes).
//
// It needs only @grpc/grpc-js and @grpc/proto-loader (reading protos/ at start-up), and the run's API token
// (<run_dir>/api_token for a local run, or the Secret on a cluster):
//
//     node calculator_env.js --port 50070 &
//     node submit_tasks.js --sampler 127.0.0.1:50051 --token-file ../../runs/local/api_token \
//         --env-endpoint 127.0.0.1:50070 --tasks 8
//
// Every registry call carries `authorization: Bearer <token>` as call metadata; a wrong token is refused
// (UNAUTHENTICATED). Metadata rather than call credentials: the API is plaintext by default, and grpc-js
// refuses call credentials on an insecure channel. Every call has a deadline.
// Exit codes: 0 done, 1 the sampler refused or failed a call, 2 bad flags or an unreadable token file.
'use strict';

const fs = require('node:fs');
const path = require('node:path');
const { parseArgs } = require('node:util');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');

const PROTOS = path.resolve(__dirname, '..', '..', 'protos');
const PROBLEMS = [
  ['What is 17 * 23?', '391'],
  ['What is 1234 + 4321?', '5555'],
  ['What is 2 ** 10?', '1024'],
  ['What is 99 * 99?', '9801'],
];
// RegisterEnvironment health-checks the endpoint (up to 5 s) before it answers
const DEADLINE_S = { register: 30, submit: 60, status: 10 };
const USAGE =
  'usage: submit_tasks.js [-h] [--sampler SAMPLER] --token-file TOKEN_FILE [--env-name ENV_NAME]\n' +
  '                       --env-endpoint ENV_ENDPOINT [--tasks TASKS] [--watch-s WATCH_S]';

class CallFailed extends Error {}

const pyRepr = (text) => (text.includes("'") && !text.includes('"') ? `"${text}"` : `'${text}'`);
const pyBool = (value) => (value ? 'True' : 'False');
const deadline = (seconds) => new Date(Date.now() + seconds * 1000);
const statusName = (err) => grpc.status[err.code] || String(err.code);
const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

function flags(argv) {
  let values;
  try {
    ({ values } = parseArgs({
      args: argv,
      options: {
        sampler: { type: 'string', default: '127.0.0.1:50051' },
        'token-file': { type: 'string' },
        'env-name': { type: 'string', default: 'calculator' },
        'env-endpoint': { type: 'string' },
        tasks: { type: 'string', default: '8' },
        'watch-s': { type: 'string', default: '30' },
        help: { type: 'boolean', short: 'h', default: false },
      },
    }));
    if (values.help) {
      console.log(USAGE);
      process.exit(0);
    }
    const missing = ['token-file', 'env-endpoint'].filter((name) => values[name] === undefined);
    if (missing.length) {
      throw new Error(`the following arguments are required: ${missing.map((n) => `--${n}`).join(', ')}`);
    }
    if (!/^\s*[-+]?\d+\s*$/.test(values.tasks)) {
      throw new Error(`argument --tasks: invalid int value: ${pyRepr(values.tasks)}`);
    }
    if (values['watch-s'].trim() === '' || Number.isNaN(Number(values['watch-s']))) {
      throw new Error(`argument --watch-s: invalid float value: ${pyRepr(values['watch-s'])}`);
    }
  } catch (err) {
    console.error(`${USAGE}\nsubmit_tasks.js: error: ${err.message}`);
    process.exit(2);
  }
  return {
    sampler: values.sampler,
    tokenFile: values['token-file'],
    envName: values['env-name'],
    envEndpoint: values['env-endpoint'],
    tasks: Number(values.tasks),
    watchS: Number(values['watch-s']),
  };
}

function unary(client, method, request, metadata, seconds) {
  return new Promise((resolve, reject) => {
    client[method](request, metadata, { deadline: deadline(seconds) }, (err, reply) =>
      err ? reject(err) : resolve(reply),
    );
  });
}

function submit(client, requests, metadata) {
  // a client stream: every task, then one answer for them all
  return new Promise((resolve, reject) => {
    const call = client.SubmitTasks(metadata, { deadline: deadline(DEADLINE_S.submit) }, (err, reply) =>
      err ? reject(err) : resolve(reply),
    );
    for (const request of requests) call.write(request);
    call.end();
  });
}

async function run(args, token) {
  const definition = protoLoader.loadSync('vcpo/v1/registry.proto', {
    keepCase: true, // the protos' own field names (session_id, max_turns), as every other client spells them
    longs: String, // uint64 counters (accepted, episodes_completed) as decimal strings, never rounded
    enums: String,
    defaults: true,
    oneofs: true,
    includeDirs: [PROTOS], // so `import "vcpo/v1/rollout.proto"` resolves
  });
  const vcpo = grpc.loadPackageDefinition(definition).vcpo.v1;
  const client = new vcpo.EnvironmentRegistry(args.sampler, grpc.credentials.createInsecure());
  const metadata = new grpc.Metadata();
  metadata.set('authorization', `Bearer ${token}`);
  try {
    const spec = {
      name: args.envName,
      endpoint: args.envEndpoint,
      tool_parser: 'json',
      scorer: 'math',
      max_turns: 4,
      step_timeout_seconds: 10,
      weight: 1.0,
    };
    let reply;
    try {
      reply = await unary(client, 'RegisterEnvironment', { spec }, metadata, DEADLINE_S.register);
    } catch (err) {
      throw new CallFailed(`registration refused: ${statusName(err)}: ${err.details}`);
    }
    console.log(`environment ${pyRepr(reply.name)} ${reply.created ? 'registered' : 'updated'}`);

    const requests = [];
    for (let i = 0; i < args.tasks; i++) {
      const [prompt, answer] = PROBLEMS[i % PROBLEMS.length];
      const task = { task_id: `${args.envName}:${i}`, prompt, reference: answer };
      requests.push({ environment: args.envName, task });
    }
    let submitted;
    try {
      submitted = await submit(client, requests, metadata);
    } catch (err) {
      throw new CallFailed(`submitting tasks failed: ${statusName(err)}: ${err.details}`);
    }
    console.log(`submitted: ${submitted.accepted} accepted, ${submitted.rejected} rejected`);
    for (const error of submitted.errors) console.log(`  ${error}`);

    const until = Date.now() + args.watchS * 1000;
    while (Date.now() < until) {
      const request = { name: args.envName };
      let status;
      try {
        status = await unary(client, 'EnvironmentStatus', request, metadata, DEADLINE_S.status);
      } catch (err) {
        throw new CallFailed(`status failed: ${statusName(err)}: ${err.details}`);
      }
      console.log(
        `healthy=${pyBool(status.healthy)} queued=${status.tasks_queued} ` +
          `running=${status.episodes_running} completed=${status.episodes_completed} ` +
          `errors=${status.errors} ${status.last_error}`,
      );
      await sleep(5000);
    }
    return 0;
  } finally {
    client.close();
  }
}

async function main() {
  const args = flags(process.argv.slice(2));
  let token;
  try {
    token = fs.readFileSync(args.tokenFile, 'utf8').trim();
  } catch (err) {
    console.error(`cannot read the API token: ${err.message}`);
    return 2;
  }
  try {
    return await run(args, token);
  } catch (err) {
    if (!(err instanceof CallFailed)) throw err;
    console.error(err.message);
    return 1;
  }
}

main().then((code) => {
  process.exitCode = code;
});
