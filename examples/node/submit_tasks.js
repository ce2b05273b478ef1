// A client of a running system in Node.js: register a custom environment, submit tasks for it, watch its
// status (examples/submit_tasks.py in another language: the same flags, lines and exit codes).
//
// It needs only @grpc/grpc-js and @grpc/proto-loader (reading protos/ at start-up). With `make run` going in
// another terminal:
//
//     node calculator_env.js --port 50070 &
//     node submit_tasks.js --env-endpoint 127.0.0.1:50070 --tasks 8
//
// It finds the run from its directory (--run-dir, default: this repository's runs/local): the sampler's port
// in <run_dir>/sampler/sampler-0.endpoints.json (the local preset gives it a free port, which its replica
// writes there when it serves) and the API token in <run_dir>/api_token (or the run's
// sampler.api_token_file). --sampler HOST:PORT and --token-file name them instead (a cluster: the Service's
// address and the Secret).
//
// Every registry call carries `authorization: Bearer <token>` as call metadata; a wrong token is refused
// (UNAUTHENTICATED). Metadata rather than call credentials: the API is plaintext by default, and grpc-js
// refuses call credentials on an insecure channel. --tls-ca (and --tls-cert/--tls-key for mutual TLS)
// reaches a sampler whose API uses TLS. Every call has a deadline.
// Exit codes: 0 done, 1 the sampler refused or failed a call, 2 bad flags, no run to reach, or no token.
'use strict';

const fs = require('node:fs');
const path = require('node:path');
const { parseArgs } = require('node:util');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');

const PROTOS = path.resolve(__dirname, '..', '..', 'protos');
const RUN_DIR = path.resolve(__dirname, '..', '..', 'runs', 'local'); // where `make run` writes
const PROBLEMS = [
  ['What is 17 * 23?', '391'],
  ['What is 1234 + 4321?', '5555'],
  ['What is 2 ** 10?', '1024'],
  ['What is 99 * 99?', '9801'],
];
// RegisterEnvironment health-checks the endpoint (up to 5 s) before it answers
const DEADLINE_S = { register: 30, submit: 60, status: 10 };
const USAGE =
  'usage: submit_tasks.js [-h] [--run-dir RUN_DIR] [--sampler SAMPLER] [--token-file TOKEN_FILE]\n' +
  '                       [--env-name ENV_NAME] --env-endpoint ENV_ENDPOINT [--tasks TASKS]\n' +
  '                       [--watch-s WATCH_S] [--tls-ca TLS_CA] [--tls-cert TLS_CERT] [--tls-key TLS_KEY]';

class CallFailed extends Error {}
// the run directory does not say where a live sampler listens, or what it needs to be reached
class NoRun extends Error {}

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
        'run-dir': { type: 'string', default: RUN_DIR },
        sampler: { type: 'string' },
        'token-file': { type: 'string' },
        'env-name': { type: 'string', default: 'calculator' },
        'env-endpoint': { type: 'string' },
        tasks: { type: 'string', default: '8' },
        'watch-s': { type: 'string', default: '30' },
        'tls-ca': { type: 'string' },
        'tls-cert': { type: 'string' },
        'tls-key': { type: 'string' },
        help: { type: 'boolean', short: 'h', default: false },
      },
    }));
    if (values.help) {
      console.log(USAGE);
      process.exit(0);
    }
    const missing = ['env-endpoint'].filter((name) => values[name] === undefined);
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
    runDir: values['run-dir'],
    sampler: values.sampler,
    tokenFile: values['token-file'],
    envName: values['env-name'],
    envEndpoint: values['env-endpoint'],
    tasks: Number(values.tasks),
    watchS: Number(values['watch-s']),
    tlsCa: values['tls-ca'],
    tlsCert: values['tls-cert'],
    tlsKey: values['tls-key'],
  };
}

function readJson(file) {
  try {
    return JSON.parse(fs.readFileSync(file, 'utf8'));
  } catch (err) {
    if (err.code === 'ENOENT') return {};
    throw err;
  }
}

// the [sampler] section of the configuration the launcher resolved for the run (empty without one)
function runSamplerConfig(runDir) {
  const resolved = path.join(runDir, 'config.resolved.json');
  return [resolved, readJson(resolved).sampler || {}];
}

// whether the process `pid` runs on this machine (an endpoints file outlives its run)
function alive(pid) {
  if (!Number.isInteger(pid)) return true; // nothing to check against
  try {
    process.kill(pid, 0);
    return true;
  } catch (err) {
    return err.code === 'EPERM'; // someone else's process, but running
  }
}

// The address of the run's first live sampler replica: each writes sampler-<i>.endpoints.json (its gRPC port
// and PID) when it serves. The run is on this machine, so the address is 127.0.0.1.
function runSampler(runDir) {
  const folder = path.join(runDir, 'sampler');
  const first = path.join(folder, 'sampler-0.endpoints.json');
  let found = [];
  try {
    found = fs.readdirSync(folder).filter((name) => /^sampler-.*\.endpoints\.json$/.test(name));
  } catch (err) {
    if (err.code !== 'ENOENT') throw err;
  }
  found = found.sort().map((name) => path.join(folder, name));
  if (!found.length) {
    throw new NoRun(
      `no sampler of a run in ${runDir}: ${first} does not exist (a run's sampler writes it when it ` +
        'serves). Start the run (make run), name its directory with --run-dir, or give the sampler\'s ' +
        'address with --sampler HOST:PORT',
    );
  }
  for (const file of found) {
    const ends = readJson(file);
    if (alive(ends.pid)) return `127.0.0.1:${ends.grpc_port}`;
  }
  throw new NoRun(
    `the run in ${runDir} is not up: ${found[0]} names process ${readJson(found[0]).pid}, which is not ` +
      "running. Start the run (make run), or give the sampler's address with --sampler HOST:PORT",
  );
}

// the file holding the run's API token: sampler.api_token_file of its resolved configuration, else the one
// the sampler creates, <run_dir>/api_token
function runTokenFile(runDir) {
  const [resolved, sampler] = runSamplerConfig(runDir);
  if (sampler.api_token) {
    throw new NoRun(
      `the run's API token is set in its configuration (sampler.api_token; ${resolved} shows it masked), ` +
        'not in a file: write it to a file and pass --token-file',
    );
  }
  return sampler.api_token_file || path.join(runDir, 'api_token');
}

// refuse to dial a run whose API uses TLS ([sampler.api_tls]) without the flags that reach it
function checkRunTls(runDir, args) {
  const [resolved, sampler] = runSamplerConfig(runDir);
  const tls = sampler.api_tls || {};
  if (tls.cert_file && args.tlsCa === undefined) {
    throw new NoRun(
      `the run's API uses TLS (sampler.api_tls in ${resolved}): pass --tls-ca with the CA that signed ` +
        tls.cert_file,
    );
  }
  if (tls.client_ca_file && args.tlsCert === undefined) {
    throw new NoRun(
      `the run's API requires a client certificate (sampler.api_tls.client_ca_file in ${resolved}): ` +
        'pass --tls-cert and --tls-key',
    );
  }
}

// plaintext, or TLS trusting --tls-ca (with --tls-cert/--tls-key as the client's certificate)
function channelCredentials(args) {
  if (args.tlsCa === undefined) return grpc.credentials.createInsecure();
  const read = (file) => (file === undefined ? null : fs.readFileSync(file));
  return grpc.credentials.createSsl(read(args.tlsCa), read(args.tlsKey), read(args.tlsCert));
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

async function run(args, token, credentials) {
  const definition = protoLoader.loadSync('vcpo/v1/registry.proto', {
    keepCase: true, // the protos' own field names (session_id, max_turns), as every other client spells them
    longs: String, // uint64 counters (accepted, episodes_completed) as decimal strings, never rounded
    enums: String,
    defaults: true,
    oneofs: true,
    includeDirs: [PROTOS], // so `import "vcpo/v1/rollout.proto"` resolves
  });
  const vcpo = grpc.loadPackageDefinition(definition).vcpo.v1;
  const client = new vcpo.EnvironmentRegistry(args.sampler, credentials);
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
  try {
    if (args.sampler === undefined) {
      checkRunTls(args.runDir, args);
      args.sampler = runSampler(args.runDir);
    }
    if (args.tokenFile === undefined) args.tokenFile = runTokenFile(args.runDir);
  } catch (err) {
    if (!(err instanceof NoRun)) throw err;
    console.error(err.message);
    return 2;
  }
  let token;
  try {
    token = fs.readFileSync(args.tokenFile, 'utf8').trim();
  } catch (err) {
    console.error(`cannot read the API token: ${err.message}`);
    return 2;
  }
  let credentials;
  try {
    credentials = channelCredentials(args);
  } catch (err) {
    console.error(`cannot read a TLS file: ${err.message}`);
    return 2;
  }
  try {
    return await run(args, token, credentials);
  } catch (err) {
    if (!(err instanceof CallFailed)) throw err;
    console.error(err.message);
    return 1;
  }
}

main().then((code) => {
  process.exitCode = code;
});
