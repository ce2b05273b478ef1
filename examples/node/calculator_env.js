// A custom tool-use environment in Node.js, served over gRPC: examples/calculator_env.py in another language.
//
// It needs only @grpc/grpc-js, @grpc/proto-loader (reading protos/ at start-up: no generated code) and
// grpc-health-check, nothing from this project's services:
//
//     cd examples/node && npm ci && node calculator_env.js --port 50070 [--max-calls 4]
//
// One tool, `calculator`: the model calls it with {"expression": "17 * 23"} (the `json` tool parser) and
// reads the value. Arithmetic only (numbers, + - * / // % **, parentheses) with Python's semantics (exact
// integers, floor division and modulo rounding down, 4 / 2 is 2.0) and the Python example's bounds, parsed
// by hand: nothing the model writes runs as code (no eval, no Function). One difference: a negative number to
// a fractional power is an error here, where Python answers with a complex number. Each session counts its
// calls; past --max-calls the episode is over. The final answer is scored by the task's scorer (the
// registration names one), so this environment gives no reward itself. Register it and submit tasks with
// submit_tasks.js.
'use strict';

const path = require('node:path');
const { parseArgs } = require('node:util');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');
const { HealthImplementation } = require('grpc-health-check');

const PROTOS = path.resolve(__dirname, '..', '..', 'protos');
const TOOL = {
  name: 'calculator',
  description: 'Evaluate an arithmetic expression.',
  // the same text as the Python example's json.dumps, so both offer the model byte-identical schemas
  parameters_json_schema:
    '{"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}',
};

// ------------------------------------------------------------------------------------------- arithmetic
// A value is a BigInt (Python's int: exact, unbounded) or a Number (Python's float).

class CalcError extends Error {}

function pyRepr(text) {
  const quote = text.includes("'") && !text.includes('"') ? '"' : "'";
  const body = text.replace(/\\/g, '\\\\').replace(/\n/g, '\\n').replace(/\t/g, '\\t');
  return quote + (quote === "'" ? body.replace(/'/g, "\\'") : body) + quote;
}

function formatFloat(x) {
  // Python's repr of a float: the shortest round-trip digits, exponent form below 1e-4 and from 1e16
  if (Number.isNaN(x)) return 'nan';
  if (!Number.isFinite(x)) return x > 0 ? 'inf' : '-inf';
  if (x === 0) return Object.is(x, -0) ? '-0.0' : '0.0';
  const sign = x < 0 ? '-' : '';
  const [mantissa, expText] = Math.abs(x).toExponential().split('e');
  const digits = mantissa.replace('.', '');
  const exp = Number(expText);
  if (exp < -4 || exp >= 16) {
    const m = digits.length > 1 ? `${digits[0]}.${digits.slice(1)}` : digits;
    return `${sign}${m}e${exp < 0 ? '-' : '+'}${String(Math.abs(exp)).padStart(2, '0')}`;
  }
  if (exp < 0) return `${sign}0.${'0'.repeat(-exp - 1)}${digits}`;
  return `${sign}${digits.slice(0, exp + 1).padEnd(exp + 1, '0')}.${digits.slice(exp + 1) || '0'}`;
}

const format = (v) => (typeof v === 'bigint' ? v.toString() : formatFloat(v));
const bitLength = (n) => (n === 0n ? 0 : (n < 0n ? -n : n).toString(2).length);

function toFloat(v) {
  if (typeof v === 'number') return v;
  const x = Number(v); // rounds to nearest, ties to even, as Python's int -> float does
  if (!Number.isFinite(x)) throw new CalcError('int too large to convert to float');
  return x;
}

function ratioToFloat(num, den, exp2) {
  // num / den * 2**exp2 (num, den positive BigInts) rounded once, half to even, subnormals included: the
  // correctly rounded double CPython's int / int and C's pow give, where a float detour would round twice
  let log2 = bitLength(num) - bitLength(den); // floor(log2(num / den)) is log2 or log2 - 1
  if ((log2 >= 0 ? num : num << BigInt(-log2)) < (log2 >= 0 ? den << BigInt(log2) : den)) log2 -= 1;
  const last = Math.max(log2 + exp2 - 52, -1074); // the exponent of the result's last bit
  const shift = exp2 - last;
  const [n, d] = shift >= 0 ? [num << BigInt(shift), den] : [num, den << BigInt(-shift)];
  let q = n / d;
  const twice = 2n * (n - q * d);
  if (twice > d || (twice === d && (q & 1n) === 1n)) q += 1n;
  return last > 971 ? Infinity : Number(q) * 2 ** last; // q < 2**54: both factors and the product exact
}

function intTrueDiv(a, b) {
  if (b === 0n) throw new CalcError('division by zero');
  if (a === 0n) return b < 0n ? -0 : 0;
  const x = ratioToFloat(a < 0n ? -a : a, b < 0n ? -b : b, 0);
  if (!Number.isFinite(x)) throw new CalcError('integer division result too large for a float');
  return a < 0n !== b < 0n ? -x : x;
}

function decompose(x) {
  // a finite positive double as [m, e] with x = m * 2**e exactly
  const view = new DataView(new ArrayBuffer(8));
  view.setFloat64(0, x);
  const bits = view.getBigUint64(0);
  const biased = Number((bits >> 52n) & 0x7ffn);
  const fraction = bits & ((1n << 52n) - 1n);
  return biased === 0 ? [fraction, -1074] : [fraction | (1n << 52n), biased - 1075];
}

function positivePow(v, w) {
  // v ** w for finite v > 0: exact, then rounded once, for whole exponents (V8's Math.pow can be an ulp
  // off there, e.g. 10 ** -5, where C's pow is not); Math.pow for fractional ones
  if (!Number.isInteger(w)) return Math.pow(v, w);
  const [m, e] = decompose(v);
  const power = m ** BigInt(Math.abs(w));
  return w >= 0 ? ratioToFloat(power, 1n, e * w) : ratioToFloat(1n, power, e * w);
}

function floatDivMod(x, y, what) {
  // CPython's float divmod: fmod, then moved toward the divisor's sign
  if (y === 0) throw new CalcError(what === 'mod' ? 'float modulo' : 'float floor division by zero');
  let mod = x % y;
  let div = (x - mod) / y;
  if (mod !== 0) {
    // (C tests a double for nonzero, NaN included; JavaScript's `if (NaN)` would not)
    if (y < 0 !== mod < 0) {
      mod += y;
      div -= 1;
    }
  } else {
    mod = y < 0 ? -0 : 0;
  }
  let floordiv;
  if (div !== 0) {
    floordiv = Math.floor(div);
    if (div - floordiv > 0.5) floordiv += 1;
  } else {
    const quotient = x / y;
    floordiv = quotient < 0 || Object.is(quotient, -0) ? -0 : 0;
  }
  return what === 'mod' ? mod : floordiv;
}

const isOddInteger = (w) => Number.isInteger(w) && Math.abs(w % 2) === 1;

function floatPow(v, w) {
  // CPython's float_pow special cases; libm's pow for the rest
  if (w === 0) return 1;
  if (Number.isNaN(v)) return v;
  if (Number.isNaN(w)) return v === 1 ? 1 : w;
  if (!Number.isFinite(w)) {
    const a = Math.abs(v);
    if (a === 1) return 1;
    return w > 0 === a > 1 ? Infinity : 0;
  }
  if (!Number.isFinite(v)) {
    if (w > 0) return isOddInteger(w) ? v : Math.abs(v);
    return isOddInteger(w) ? (v < 0 ? -0 : 0) : 0;
  }
  if (v === 0) {
    if (w < 0) throw new CalcError('0.0 cannot be raised to a negative power');
    return isOddInteger(w) ? v : 0;
  }
  let negate = false;
  if (v < 0) {
    if (w !== Math.floor(w)) {
      // Python answers with a complex number here; this example keeps to real numbers
      throw new CalcError('a negative number to a fractional power is not a real number');
    }
    v = -v;
    negate = isOddInteger(w);
  }
  if (v === 1) return negate ? -1 : 1;
  const x = positivePow(v, w);
  if (!Number.isFinite(x)) throw new CalcError("(34, 'Numerical result out of range')");
  return negate ? -x : x;
}

function binary(op, left, right) {
  const ints = typeof left === 'bigint' && typeof right === 'bigint';
  if (op === '**') {
    const big = typeof right === 'bigint' ? right > 100n || right < -100n : Math.abs(right) > 100;
    if (big) throw new CalcError('exponent too large');
    if (ints && right >= 0n) return left ** right;
    return floatPow(toFloat(left), toFloat(right));
  }
  if (ints) {
    switch (op) {
      case '+': return left + right;
      case '-': return left - right;
      case '*': return left * right;
      case '/': return intTrueDiv(left, right);
      case '//': {
        if (right === 0n) throw new CalcError('integer division or modulo by zero');
        const q = left / right;
        return left % right !== 0n && left < 0n !== right < 0n ? q - 1n : q;
      }
      case '%': {
        if (right === 0n) throw new CalcError('integer modulo by zero');
        const r = left % right;
        return r !== 0n && r < 0n !== right < 0n ? r + right : r;
      }
    }
  }
  const [x, y] = [toFloat(left), toFloat(right)];
  switch (op) {
    case '+': return x + y;
    case '-': return x - y;
    case '*': return x * y;
    case '/':
      if (y === 0) throw new CalcError('float division by zero');
      return x / y;
    case '//': return floatDivMod(x, y, 'div');
    case '%': return floatDivMod(x, y, 'mod');
  }
  throw new CalcError(`not arithmetic: operator ${op}`);
}

// Python's numeric literals: imaginary (refused below), float, then int; '_' between digits
const DIGITS = '[0-9](?:_?[0-9])*';
const EXPONENT = `[eE][-+]?${DIGITS}`;
const FLOAT = `(?:${DIGITS}\\.(?:${DIGITS})?|\\.${DIGITS})(?:${EXPONENT})?|${DIGITS}${EXPONENT}`;
const INT = '0[xX](?:_?[0-9a-fA-F])+|0[bB](?:_?[01])+|0[oO](?:_?[0-7])+|0(?:_?0)*|[1-9](?:_?[0-9])*';
const NUMBER = new RegExp(`(?:(${FLOAT}|${DIGITS})[jJ])|(${FLOAT})|(${INT})`, 'y');
const OPERATOR = /\*\*|\/\/|[-+*/%()]/y;

function tokenize(text) {
  const tokens = [];
  let depth = 0;
  let i = 0;
  if (/^[ \t\f]/.test(text)) throw new CalcError('unexpected indent');
  while (i < text.length) {
    const ch = text[i];
    if (ch === ' ' || ch === '\t' || ch === '\f' || ch === '\r' || ch === '\n') {
      // a line break ends a Python expression unless a parenthesis is open
      if (ch === '\n' && depth === 0 && text.slice(i).trim() !== '') throw new CalcError('invalid syntax');
      i += 1;
      continue;
    }
    NUMBER.lastIndex = i;
    const number = NUMBER.exec(text);
    if (number) {
      i = NUMBER.lastIndex;
      if (/[0-9]/.test(text[i] || '') && number[3] && /^0+$/.test(number[3].replace(/_/g, ''))) {
        throw new CalcError('leading zeros in decimal integer literals are not permitted');
      }
      if (/[A-Za-z0-9_]/.test(text[i] || '')) throw new CalcError('invalid decimal literal');
      if (number[1] !== undefined) throw new CalcError(`not arithmetic: the complex number ${number[0]}`);
      const literal = (number[2] || number[3]).replace(/_/g, '');
      tokens.push({ kind: 'number', value: number[2] !== undefined ? Number(literal) : BigInt(literal) });
      continue;
    }
    OPERATOR.lastIndex = i;
    const operator = OPERATOR.exec(text);
    if (!operator) throw new CalcError(`not arithmetic: ${pyRepr(text.slice(i, i + 20))}`);
    i = OPERATOR.lastIndex;
    if (operator[0] === '(' && ++depth > 200) throw new CalcError('too many nested parentheses');
    if (operator[0] === ')' && --depth < 0) throw new CalcError("unmatched ')'");
    tokens.push({ kind: operator[0] });
  }
  if (depth > 0) throw new CalcError("'(' was never closed");
  return tokens;
}

function parse(tokens) {
  // Python's grammar and precedence: sum > term > unary (+ -) > power (right-associative, binding tighter
  // than a unary minus on its left: -2 ** 2 is -4) > number or parenthesis. The whole expression is parsed
  // before anything is computed, as Python does, so a syntax error is reported as one.
  let at = 0;
  const peek = () => (tokens[at] || { kind: 'end' }).kind;
  const expect = (kind) => {
    if (peek() !== kind) throw new CalcError('invalid syntax');
    at += 1;
  };
  function atom() {
    const token = tokens[at];
    if (token && token.kind === 'number') {
      at += 1;
      return token;
    }
    expect('(');
    const node = sum();
    expect(')');
    return node;
  }
  function power() {
    const base = atom();
    if (peek() !== '**') return base;
    at += 1;
    return { kind: 'binary', op: '**', left: base, right: unary() };
  }
  function unary() {
    const op = peek();
    if (op !== '-' && op !== '+') return power();
    at += 1;
    return { kind: 'unary', op, operand: unary() };
  }
  function chain(operand, ops) {
    let node = operand();
    while (ops.includes(peek())) {
      const op = tokens[at++].kind;
      node = { kind: 'binary', op, left: node, right: operand() };
    }
    return node;
  }
  const term = () => chain(unary, ['*', '/', '//', '%']);
  const sum = () => chain(term, ['+', '-']);
  const tree = sum();
  if (at !== tokens.length) throw new CalcError('invalid syntax');
  return tree;
}

function walk(node) {
  if (node.kind === 'number') return node.value;
  if (node.kind === 'unary') {
    const value = walk(node.operand);
    return node.op === '-' ? -value : value;
  }
  const value = binary(node.op, walk(node.left), walk(node.right));
  if (typeof value === 'bigint' && bitLength(value) > 4096) {
    throw new CalcError('number too large'); // bounds the work of what follows
  }
  return value;
}

function evaluate(expression) {
  // The value of an arithmetic expression; a CalcError saying why for anything else
  if (expression.length > 1000) throw new CalcError('expression too long');
  return walk(parse(tokenize(expression)));
}

// ------------------------------------------------------------------------------------------- the server

function pyStr(value) {
  // str() of what JSON gave: Python's spelling where the model could have sent it
  if (typeof value === 'string') return value;
  if (typeof value === 'number') return Number.isInteger(value) ? String(value) : formatFloat(value);
  return JSON.stringify(value);
}

function answer(action, calls, maxCalls) {
  let text;
  try {
    if (action.tool_name !== 'calculator') {
      throw new CalcError(`unknown tool ${pyRepr(action.tool_name)}; the tool is 'calculator'`);
    }
    const args = JSON.parse(action.arguments_json);
    if (args === null || typeof args !== 'object' || Array.isArray(args)) {
      throw new CalcError('the arguments must be a JSON object');
    }
    if (!('expression' in args)) throw new CalcError("'expression'");
    text = format(evaluate(pyStr(args.expression)));
  } catch (err) {
    if (!(err instanceof CalcError || err instanceof SyntaxError || err instanceof RangeError)) throw err;
    text = `error: ${err.message}`; // the model's mistake: it reads why
  }
  return { observation: { text }, done: calls >= maxCalls };
}

function calculator(maxCalls) {
  const calls = new Map(); // session id -> calls so far (one event loop: no lock needed)
  return {
    Reset(call, callback) {
      calls.set(call.request.session_id, 0);
      callback(null, { tools: [TOOL] });
    },
    Step(call, callback) {
      const session = call.request.session_id;
      if (!calls.has(session)) {
        callback({ code: grpc.status.NOT_FOUND, details: `unknown session ${pyRepr(session)}` });
        return;
      }
      calls.set(session, calls.get(session) + 1);
      callback(null, answer(call.request.action || {}, calls.get(session), maxCalls));
    },
    Close(call, callback) {
      calls.delete(call.request.session_id);
      callback(null, {});
    },
  };
}

function flags(argv) {
  const usage = 'usage: calculator_env.js [-h] [--port PORT] [--host HOST] [--max-calls MAX_CALLS]';
  let values;
  try {
    ({ values } = parseArgs({
      args: argv,
      options: {
        port: { type: 'string', default: '50070' },
        host: { type: 'string', default: '127.0.0.1' },
        'max-calls': { type: 'string', default: '4' },
        help: { type: 'boolean', short: 'h', default: false },
      },
    }));
    for (const name of ['port', 'max-calls']) {
      if (!/^[-+]?\d+$/.test(values[name].trim())) {
        throw new Error(`argument --${name}: invalid int value: ${pyRepr(values[name])}`);
      }
    }
  } catch (err) {
    console.error(`${usage}\ncalculator_env.js: error: ${err.message}`);
    process.exit(2);
  }
  if (values.help) {
    console.log(usage);
    process.exit(0);
  }
  return { port: Number(values.port), host: values.host, maxCalls: Number(values['max-calls']) };
}

function main() {
  const args = flags(process.argv.slice(2));
  const definition = protoLoader.loadSync('vcpo/v1/environment.proto', {
    keepCase: true,
    longs: String,
    enums: String,
    defaults: true,
    oneofs: true,
    includeDirs: [PROTOS],
  });
  const vcpo = grpc.loadPackageDefinition(definition).vcpo.v1;
  const server = new grpc.Server();
  server.addService(vcpo.Environment.service, calculator(args.maxCalls));
  // the sampler checks health at registration: SERVING for the service by name and for the whole server
  new HealthImplementation({ '': 'SERVING', 'vcpo.v1.Environment': 'SERVING' }).addToServer(server);
  const address = `${args.host}:${args.port}`;
  server.bindAsync(address, grpc.ServerCredentials.createInsecure(), (err, port) => {
    if (err) {
      console.error(`cannot listen on ${address}: ${err.message}`);
      process.exit(1);
    }
    console.log(`listening on ${args.host}:${port}`);
  });
  const stop = () => {
    const force = setTimeout(() => server.forceShutdown(), 2000); // a 2 s grace, as the Python example
    server.tryShutdown(() => clearTimeout(force));
  };
  process.on('SIGINT', stop);
  process.on('SIGTERM', stop);
}

if (require.main === module) main();

module.exports = { evaluate, format, TOOL };
