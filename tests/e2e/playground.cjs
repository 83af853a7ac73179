// The playground in headless Chromium (playwright-core driving Debian's chromium), run by
// `cargo xtask test` (alone: `cargo xtask e2e`). Four runs:
//   1. the page served by `kvlens serve`, on WebGPU (SwiftShader): load the demo model, send an
//      image and a question, watch the KV blocks fill and empty, the encoder cache get one entry,
//      the same image again hit it, the reset empty it; the planner link; screenshots;
//   2. dist/ on a plain static file server with WebGPU off: the CPU backend in wasm;
//   3. server mode (the page from the static server) against a `kvlens serve`: a chat request
//      sent to the server shows up in the page; 4. server mode against a fake vLLM /metrics.
// The greedy tokens of runs 1 and 2 must equal native `kvlens generate --backend cpu`'s. Runs 1
// and 2 also load the demo model's f16 GGUF pair (dist/demo-gguf/) by URL, the header first by a
// range request (kvlens serve answers it; the static server ignores it and the page reads only the
// start), and from disk; its tokens must equal native generate's on the same pair. In a profile
// kept on disk, the pair by URL is kept in Cache Storage whole and a reload reads it from there.
//
// 5. `kvlens watch` against a fake vLLM KV event publisher (vLLM's event classes, msgspec, pyzmq)
// and a recent vLLM's /metrics: the grid follows stores, removals, a lost batch (replay) and a
// publisher restart, and the planner's figures stand beside the server's.
//
// Environment (set by the xtask): KVLENS_BIN, KVLENS_DIST, KVLENS_E2E_IMAGE, KVLENS_E2E_PROMPT,
// KVLENS_E2E_MAX_TOKENS, KVLENS_E2E_EXPECTED (generate's JSON), KVLENS_E2E_EXPECTED_GGUF (on the
// GGUF pair), KVLENS_E2E_ARTIFACTS, CHROMIUM, CHROMIUM_ARGS (JSON list), PYTHON, CLIENT_PYTHON (with msgspec
// and pyzmq).
'use strict';
const { chromium } = require('playwright-core');
const { spawn } = require('child_process');
const fs = require('fs');
const path = require('path');

const env = (k) => {
  if (!process.env[k]) throw new Error(`${k} is not set (run through cargo xtask test)`);
  return process.env[k];
};
const KVLENS = env('KVLENS_BIN');
const DIST = env('KVLENS_DIST');
const IMAGE = env('KVLENS_E2E_IMAGE');
const PROMPT = env('KVLENS_E2E_PROMPT');
const MAX_TOKENS = env('KVLENS_E2E_MAX_TOKENS');
const EXPECTED = JSON.parse(fs.readFileSync(env('KVLENS_E2E_EXPECTED'), 'utf8'));
const EXPECTED_GGUF = JSON.parse(fs.readFileSync(env('KVLENS_E2E_EXPECTED_GGUF'), 'utf8'));
const EXPECTED_GGUF_TEXT = JSON.parse(fs.readFileSync(env('KVLENS_E2E_EXPECTED_GGUF_TEXT'), 'utf8'));
const GGUF = ['demo-gguf/demo-model-F16.gguf', 'demo-gguf/mmproj-demo-model-F16.gguf'];
const ARTIFACTS = env('KVLENS_E2E_ARTIFACTS');
const CHROMIUM = env('CHROMIUM');
const CHROMIUM_ARGS = JSON.parse(env('CHROMIUM_ARGS'));
const PYTHON = env('PYTHON');
const CLIENT_PYTHON = env('CLIENT_PYTHON');
// A tiny random Qwen3.5 checkpoint (Gated DeltaNet layers with a state slot per request).
const HYBRID = env('KVLENS_E2E_HYBRID');
const HERE = __dirname;
// A 512×512 image (256 image tokens for the demo model), for the main-thread measurement.
const LARGE_IMAGE = path.join(HERE, 'fixtures', 'wave_512x512.png');
// Generous: CI has 2 busy cores and SwiftShader runs WebGPU on them.
const LONG = 300_000;

const children = [];
let failures = 0;
let passes = 0;

function start(cmd, args, name, stdin = 'ignore') {
  const child = spawn(cmd, args, { stdio: [stdin, 'pipe', 'pipe'] });
  const log = fs.createWriteStream(path.join(ARTIFACTS, `${name}.log`));
  child.stdout.pipe(log);
  child.stderr.pipe(log);
  children.push(child);
  return child;
}

// Starts `cmd args`, which listen on a port they pick themselves (port 0), and resolves with
// that port once a line of their output matches `pattern` (group 1: the port). Picking a free
// port here and passing it on would leave a moment in which another process could take it.
function startListening(cmd, args, name, pattern, stdin = 'ignore') {
  const child = start(cmd, args, name, stdin);
  return new Promise((resolve, reject) => {
    let seen = '';
    const done = (f, v) => {
      clearTimeout(timer);
      child.stdout.off('data', onData);
      child.stderr.off('data', onData);
      f(v);
    };
    const timer = setTimeout(() => done(reject, new Error(`${name} printed no address (see ${name}.log)`)), LONG);
    const onData = (chunk) => {
      seen += chunk.toString();
      const m = pattern.exec(seen);
      if (m) done(resolve, Number(m[1]));
    };
    child.stdout.on('data', onData);
    child.stderr.on('data', onData);
    child.on('exit', (code) => done(reject, new Error(`${name} exited with ${code} before listening (see ${name}.log)`)));
  }).then((port) => ({ port, child }));
}

// Polls `url` until it answers (any status), the child dies or the deadline passes.
async function waitHttp(url, child, name) {
  const deadline = Date.now() + LONG;
  while (Date.now() < deadline) {
    if (child.exitCode !== null) throw new Error(`${name} exited with ${child.exitCode} (see ${name}.log)`);
    try {
      await fetch(url);
      return;
    } catch (_) {
      await new Promise((r) => setTimeout(r, 200));
    }
  }
  throw new Error(`${name} did not answer ${url}`);
}

async function kvlensServe(name, extra = []) {
  const { port, child } = await startListening(
    KVLENS,
    ['serve', '--playground-dir', DIST, '--host', '127.0.0.1', '--port', '0', ...extra],
    name,
    /Starting vLLM API server on http:\/\/[^\s]*:(\d+)\s/,
  );
  const base = `http://127.0.0.1:${port}`;
  // /health answers 503 until the engine has started; wait for 200.
  const deadline = Date.now() + LONG;
  for (;;) {
    await waitHttp(`${base}/health`, child, name);
    if ((await fetch(`${base}/health`)).status === 200) return base;
    if (Date.now() > deadline) throw new Error(`${name} never became healthy`);
    await new Promise((r) => setTimeout(r, 300));
  }
}

async function staticServer(name) {
  const { port, child } = await startListening(
    PYTHON,
    ['-u', '-m', 'http.server', '0', '--bind', '127.0.0.1', '--directory', DIST],
    name,
    /Serving HTTP on \S+ port (\d+) \(/,
  );
  const base = `http://127.0.0.1:${port}`;
  await waitHttp(`${base}/`, child, name);
  return base;
}

async function browser(webgpu) {
  const args = CHROMIUM_ARGS.filter((a) => webgpu || !a.includes('webgpu'));
  if (!webgpu) args.push('--disable-features=WebGPU');
  return chromium.launch({ executablePath: CHROMIUM, args, headless: true });
}

// KVLENS_E2E_ONLY=text runs only the checks whose name holds it (while working on one).
const ONLY = process.env.KVLENS_E2E_ONLY;

async function check(name, fn) {
  if (ONLY && !name.includes(ONLY)) return;
  const t0 = Date.now();
  try {
    await fn();
    passes += 1;
    console.log(`e2e ${name} ... ok (${((Date.now() - t0) / 1000).toFixed(1)} s)`);
  } catch (e) {
    failures += 1;
    console.log(`e2e ${name} ... FAILED\n${e.stack || e}`);
  }
}

// Screenshots are artifacts, not assertions: one that cannot be taken (a page that keeps
// repainting on 2 busy cores) is reported and the check goes on.
async function screenshot(page, name) {
  try {
    await page.screenshot({ path: path.join(ARTIFACTS, name), fullPage: true, animations: 'disabled', timeout: 120_000 });
  } catch (e) {
    console.log(`(screenshot ${name} not taken: ${String(e).split('\n')[0]})`);
  }
}

const byTest = (page, id) => page.locator(`[data-testid="${id}"]`);

// In `waitForFunction` predicates an element is read with `?.`: a predicate that throws (an
// element the wasm app has not rendered yet, on 2 busy cores) fails the wait at once instead of
// being polled again.

function assert(cond, msg) {
  if (!cond) throw new Error(msg);
}

async function newPage(b, name) {
  const page = await b.newPage({ viewport: { width: 1400, height: 1000 } });
  page.on('console', (m) => fs.appendFileSync(path.join(ARTIFACTS, `${name}-console.log`), `${m.type()}: ${m.text()}\n`));
  page.on('pageerror', (e) => fs.appendFileSync(path.join(ARTIFACTS, `${name}-console.log`), `pageerror: ${e}\n`));
  return page;
}

// Records every text the element `id` shows from now on, with whether a reply was in flight.
async function recordTexts(page, id) {
  await page.evaluate((id) => {
    window.__seen = window.__seen || {};
    const seen = (window.__seen[id] = []);
    const note = () => {
      const el = document.querySelector(`[data-testid="${id}"]`);
      const live = document.querySelector('[data-testid="assistant-message"][data-done="false"]') !== null;
      if (el) seen.push({ text: el.textContent, live });
    };
    note();
    new MutationObserver(note).observe(document.body, { subtree: true, childList: true, characterData: true });
  }, id);
}

// Loads the demo model (`click`: false when the caller clicked already) and waits until it is ready.
async function loadDemo(page, click = true) {
  if (click) await byTest(page, 'load-demo').click();
  await page.waitForFunction(
    () => {
      const s = document.querySelector('[data-testid="model-status"]')?.textContent || '';
      return s.includes('ready') || s.includes('not loaded');
    },
    null,
    { timeout: LONG },
  );
  const status = await byTest(page, 'model-status').textContent();
  assert(status.includes('ready'), `the demo model did not load: ${status}`);
  return status;
}

// Sends the image (the test's, or `image`) and the prompt; returns the finished assistant
// message's token ids.
async function ask(page, nth, image = IMAGE) {
  await byTest(page, 'max-tokens').fill(MAX_TOKENS);
  await byTest(page, 'max-tokens').dispatchEvent('change');
  if (image) {
    await byTest(page, 'image-input').setInputFiles(image);
    await page.waitForSelector('.pending img', { timeout: LONG });
  }
  await byTest(page, 'chat-input').fill(PROMPT);
  await byTest(page, 'send').click();
  const reply = byTest(page, 'assistant-message').nth(nth);
  await reply.waitFor({ timeout: LONG });
  await page.waitForFunction(
    (n) => document.querySelectorAll('[data-testid="assistant-message"]')[n]?.dataset.done === 'true',
    nth,
    { timeout: LONG },
  );
  const ids = (await reply.getAttribute('data-token-ids')).split(',').filter((s) => s).map(Number);
  return ids;
}

function sameTokens(got, what, expected = EXPECTED) {
  const want = expected.token_ids;
  assert(
    JSON.stringify(got) === JSON.stringify(want),
    `${what}: greedy tokens differ from native kvlens generate --backend cpu\n  browser: ${got}\n   native: ${want}`,
  );
}

const blocksInUse = (text) => Number((/^(\d+)\//.exec(text) || [])[1]);

async function playgroundOnWebGpu(base) {
  const b = await browser(true);
  try {
    const page = await newPage(b, 'webgpu');
    await page.goto(`${base}/`);
    await page.waitForFunction(() => !(document.querySelector('[data-testid="device"]')?.textContent ?? 'looking').includes('looking'), null, { timeout: LONG });
    const device = await byTest(page, 'device').textContent();
    assert(device.startsWith('WebGPU'), `no WebGPU adapter in the page: ${device}`);
    await loadDemo(page);
    assert((await byTest(page, 'verdict').textContent()).includes('fits'), 'the verdict before loading is missing');
    assert(/\d+ tensors on the device/.test(await byTest(page, 'load-progress').textContent()), 'no load progress');
    await recordTexts(page, 'kv-usage');
    const first = await ask(page, 0);
    sameTokens(first, 'WebGPU');
    const seen = await page.evaluate(() => window.__seen['kv-usage']);
    assert(seen.some((s) => s.live && blocksInUse(s.text) > 0), `kv-usage never showed blocks in use during generation: ${JSON.stringify(seen)}`);
    await page.waitForFunction(() => /^0\//.test(document.querySelector('[data-testid="kv-usage"]')?.textContent || ''), null, { timeout: LONG });
    const cached = await page.locator('[data-testid="kv-grid"] .cell.cached').first().getAttribute('title');
    assert(/prefix cache · hash [0-9a-f]{16}/.test(cached || ''), `a cached-free block's tooltip has no hash: ${cached}`);
    const ec = await byTest(page, 'encoder-cache-usage').textContent();
    assert(/^1 entry, \d+\/\d+ tokens$/.test(ec), `encoder cache after one image: ${ec}`);
    await screenshot(page, 'playground-chat.png');

    const hits = Number(await byTest(page, 'encoder-cache-hits').textContent());
    await ask(page, 1);
    const ec2 = await byTest(page, 'encoder-cache-usage').textContent();
    assert(ec2.startsWith('1 entry,'), `the same image again added an entry: ${ec2}`);
    const hits2 = Number(await byTest(page, 'encoder-cache-hits').textContent());
    assert(hits2 > hits, `the same image again did not hit the encoder cache (${hits} -> ${hits2})`);

    await byTest(page, 'reset-encoder-cache').click();
    await page.waitForFunction(() => (document.querySelector('[data-testid="encoder-cache-usage"]')?.textContent || '').startsWith('0 entries'), null, { timeout: LONG });
    assert((await byTest(page, 'reset-result').textContent()).includes('freed'), 'the reset does not say what it freed');
  } finally {
    await b.close();
  }
}

// "1.23 MiB" or "4.5 KiB" in bytes.
function bytesOf(text) {
  const m = /([\d.]+) (MiB|KiB)/.exec(text || '');
  assert(m, `no size in ${JSON.stringify(text)}`);
  return Number(m[1]) * (m[2] === 'MiB' ? 1048576 : 1024);
}

// The ledger's weights, once the memory view shows a value other than `not`.
async function weightsHeld(page, not) {
  const legend = page.locator('.local .legend li').filter({ hasText: /^weights / }).first();
  await page.waitForFunction(
    (not) => [...document.querySelectorAll('.local .legend li')].some((li) => /^weights /.test(li.textContent) && li.textContent !== not),
    not,
    { timeout: LONG },
  );
  return legend.textContent();
}

// The planned weights in the verdict shown once it names `format`.
async function weightsPlanned(page, format) {
  await page.waitForFunction((f) => (document.querySelector('[data-testid="verdict"]')?.textContent || '').includes(`(${f}`), format, { timeout: LONG });
  const verdict = await byTest(page, 'verdict').textContent();
  return bytesOf(/weights ([\d.]+ (MiB|KiB))/.exec(verdict)[1]);
}

// The demo model's GGUF pair loaded from `base` by URL (`fromDisk`: picked files instead), on
// WebGPU or the CPU backend: the verdict counts the tensors as stored before any weight is fetched
// and the device then holds that (within 1 %: both also count buffers that do not change); the
// header is fetched by a range request first (`ranged`: the server answers it with 206); the
// greedy tokens are native generate's on the same pair. From disk, the text model is then loaded
// alone: fewer bytes planned and held, images refused, the pair's reply to a text prompt.
// `threads`: the CPU backend's threads asked for by the page's `?threads=` (helper workers, on a
// cross-origin isolated page); the products' rows they compute (the lm_head's, on the demo
// model) must give the same tokens.
async function playgroundGguf(base, webgpu, { fromDisk = false, ranged = false, threads = 0 } = {}) {
  const b = await browser(webgpu);
  try {
    const page = await newPage(b, `${webgpu ? 'webgpu' : 'cpu'}-gguf${fromDisk ? '-disk' : ''}${threads ? `-${threads}-threads` : ''}`);
    const fetched = [];
    // Responses as their headers arrive: the page stops reading a header's response once it has
    // the header, so such a request never finishes.
    page.context().on('response', (r) => {
      if (r.url().endsWith('.gguf')) fetched.push({ url: r.url(), range: r.request().headers().range || null, status: r.status() });
    });
    await page.goto(`${base}/${threads ? `?threads=${threads}` : ''}`);
    const device = webgpu ? 'WebGPU' : 'CPU backend';
    await page.waitForFunction((d) => (document.querySelector('[data-testid="device"]')?.textContent ?? '').startsWith(d), device, { timeout: LONG });
    if (threads) {
      const text = await byTest(page, 'device').textContent();
      assert(text.includes(`, ${threads} threads`), `asked for ${threads} threads: ${text}`);
    }
    if (fromDisk) {
      await byTest(page, 'checkpoint-files').setInputFiles(GGUF.map((f) => path.join(DIST, f)));
      await byTest(page, 'load-files').click();
    } else {
      await byTest(page, 'checkpoint-url').fill(`${base}/${GGUF[0]}`);
      await byTest(page, 'checkpoint-mmproj-url').fill(`${base}/${GGUF[1]}`);
      await byTest(page, 'load-url').click();
    }
    const planned = await weightsPlanned(page, 'as stored in the GGUF files');
    const status = await loadDemo(page, false);
    // The demo model's one matrix of enough rows, the lm_head, shared with the helper.
    if (threads) assert(/helper workers hold [1-9][\d.]* MiB of weight rows/.test(status), `no rows shared with the helpers: ${status}`);
    const held = bytesOf(await weightsHeld(page, ''));
    assert(Math.abs(held - planned) <= 0.01 * planned, `the device holds ${held} bytes of weights, the verdict planned ${planned}`);
    sameTokens(await ask(page, 0), `GGUF pair on ${device}`, EXPECTED_GGUF);
    if (fromDisk) await textModelAlone(page, planned);
    if (!fromDisk) {
      const headers = fetched.filter((f) => f.range);
      assert(headers.length === 2, `the two headers were not asked for by range: ${JSON.stringify(fetched)}`);
      if (ranged) assert(headers.every((f) => f.status === 206), `the range requests were not answered with 206: ${JSON.stringify(fetched)}`);
    }
    if (webgpu) await screenshot(page, `playground-gguf${fromDisk ? '-disk' : ''}.png`);
  } finally {
    await b.close();
  }
}

// The demo model's GGUF pair by URL in a browser profile kept on disk (Cache Storage lasts there):
// the first load reads the files from the network and keeps them whole in Cache Storage, byte for
// byte; the page reloaded loads them from there, with no request for either file, and answers
// with the same tokens.
async function playgroundGgufKept(base) {
  const profile = fs.mkdtempSync(path.join(require('os').tmpdir(), 'kvlens-e2e-profile-'));
  const args = CHROMIUM_ARGS.filter((a) => !a.includes('webgpu')).concat('--disable-features=WebGPU');
  const context = await chromium.launchPersistentContext(profile, { executablePath: CHROMIUM, args, headless: true });
  try {
    const page = context.pages()[0] ?? (await context.newPage());
    page.on('console', (m) => fs.appendFileSync(path.join(ARTIFACTS, 'cpu-gguf-kept-console.log'), `${m.type()}: ${m.text()}\n`));
    const fetched = [];
    context.on('response', (r) => {
      if (r.url().endsWith('.gguf')) fetched.push({ url: r.url(), range: r.request().headers().range || null });
    });
    const load = async () => {
      await page.goto(`${base}/`);
      await page.waitForFunction(() => (document.querySelector('[data-testid="device"]')?.textContent ?? '').startsWith('CPU backend'), null, { timeout: LONG });
      await byTest(page, 'checkpoint-url').fill(`${base}/${GGUF[0]}`);
      await byTest(page, 'checkpoint-mmproj-url').fill(`${base}/${GGUF[1]}`);
      await byTest(page, 'load-url').click();
      await loadDemo(page, false);
      sameTokens(await ask(page, 0), 'GGUF pair by URL, kept in Cache Storage', EXPECTED_GGUF);
    };
    await load();
    const whole = fetched.filter((f) => !f.range).map((f) => f.url);
    assert(GGUF.every((g) => whole.includes(`${base}/${g}`)), `the first load did not fetch both files whole: ${JSON.stringify(fetched)}`);
    // The copies are written while the files are read and kept once read whole.
    const digests = await page.waitForFunction(
      async (urls) => {
        const cache = await caches.open('kvlens-checkpoints');
        const kept = await Promise.all(urls.map((u) => cache.match(u)));
        if (kept.some((r) => !r)) return false;
        const hex = (b) => [...new Uint8Array(b)].map((x) => x.toString(16).padStart(2, '0')).join('');
        return Promise.all(kept.map(async (r) => hex(await crypto.subtle.digest('SHA-256', await r.arrayBuffer()))));
      },
      GGUF.map((g) => `${base}/${g}`),
      { timeout: LONG, polling: 500 },
    );
    const want = GGUF.map((g) => require('crypto').createHash('sha256').update(fs.readFileSync(path.join(DIST, g))).digest('hex'));
    assert(JSON.stringify(await digests.jsonValue()) === JSON.stringify(want), 'Cache Storage keeps other bytes than the files');
    fetched.length = 0;
    await load();
    assert(fetched.length === 0, `the reload fetched the pair again: ${JSON.stringify(fetched)}`);
  } finally {
    await context.close();
    fs.rmSync(profile, { recursive: true, force: true });
  }
}

// The pair's text model picked alone, after the pair: the verdict plans fewer bytes than the
// pair's `pairPlanned` and the device holds that, an image is refused naming the missing
// projector, and a text prompt gets native generate's reply on the text model alone (which is
// the pair's: server/tests/gguf.rs).
async function textModelAlone(page, pairPlanned) {
  const before = await byTest(page, 'verdict').textContent();
  const heldBefore = await weightsHeld(page, '');
  await byTest(page, 'checkpoint-files').setInputFiles([path.join(DIST, GGUF[0])]);
  await byTest(page, 'load-files').click();
  await page.waitForFunction(
    (b) => {
      const v = document.querySelector('[data-testid="verdict"]')?.textContent || '';
      return v !== b && v.includes('(as stored in the GGUF files');
    },
    before,
    { timeout: LONG },
  );
  const verdict = await byTest(page, 'verdict').textContent();
  const planned = bytesOf(/weights ([\d.]+ (MiB|KiB))/.exec(verdict)[1]);
  assert(planned < pairPlanned, `the text model alone plans ${planned} bytes, the pair ${pairPlanned}`);
  await loadDemo(page, false);
  const held = bytesOf(await weightsHeld(page, heldBefore));
  assert(Math.abs(held - planned) <= 0.01 * planned, `the text model alone holds ${held} bytes, the verdict planned ${planned}`);
  await byTest(page, 'image-input').setInputFiles(IMAGE);
  await page.waitForSelector('.pending img', { timeout: LONG });
  await byTest(page, 'chat-input').fill(PROMPT);
  await byTest(page, 'send').click();
  await page.waitForFunction(
    () => (document.querySelector('[data-testid="chat-error"]')?.textContent || '').includes('without its vision tower'),
    null,
    { timeout: LONG },
  );
  sameTokens(await ask(page, 0, null), 'GGUF text model alone', EXPECTED_GGUF_TEXT);
}

// The demo model loaded in f32, then in q4_0, on WebGPU or (`webgpu` false) on the CPU backend in
// wasm: what the device holds shrinks by what the planner's verdict says it saves (within 1 %;
// both also count buffers that do not change), and the engine generates on the quantized weights.
async function playgroundQuantized(base, webgpu, threads = 0) {
  const b = await browser(webgpu);
  try {
    const page = await newPage(b, `${webgpu ? 'webgpu' : 'cpu'}-q4_0${threads ? `-${threads}-threads` : ''}`);
    await page.goto(`${base}/${threads ? `?threads=${threads}` : ''}`);
    const device = webgpu ? 'WebGPU' : 'CPU backend';
    await page.waitForFunction((d) => (document.querySelector('[data-testid="device"]')?.textContent ?? '').startsWith(d), device, { timeout: LONG });
    await loadDemo(page);
    const planned32 = await weightsPlanned(page, 'f32');
    const held32Text = await weightsHeld(page, '');
    await byTest(page, 'weights-format').selectOption('q4_0');
    await byTest(page, 'load-demo').click();
    // The verdict names q4_0 before the weights load; only then is the status of this load.
    const planned4 = await weightsPlanned(page, 'q4_0');
    await loadDemo(page, false);
    const held4Text = await weightsHeld(page, held32Text);
    const [held32, engine4] = [bytesOf(held32Text), bytesOf(held4Text)];
    // With helpers the engine holds none of the rows they hold of a q4_0 matrix it only
    // multiplies by (the untied lm_head): the two together are the weights.
    const helpers = /helper workers hold ([\d.]+) MiB of weight rows/.exec(await byTest(page, 'model-status').textContent());
    if (threads) assert(helpers && Number(helpers[1]) > 0, 'no rows shared with the helpers');
    const held4 = engine4 + (threads ? Number(helpers[1]) * 1048576 : 0);
    assert(held4 < 0.3 * held32, `q4_0 weights ${held4} bytes against f32 ${held32}`);
    const saved = held32 - held4;
    const plannedSaving = planned32 - planned4;
    assert(Math.abs(saved - plannedSaving) <= 0.01 * plannedSaving, `q4_0 saved ${saved} bytes on the device, the verdicts ${plannedSaving}`);
    const ids = await ask(page, 0);
    assert(ids.length > 0, 'no tokens generated on q4_0 weights');
    if (webgpu) await screenshot(page, 'playground-q4_0.png');
  } finally {
    await b.close();
  }
}

async function plannerLink(base) {
  const b = await browser(true);
  try {
    const page = await newPage(b, 'planner');
    await page.goto(`${base}/planner?model=Qwen3-VL-32B-Instruct&device=ascend-910b-64g&tp=2&kv_cache_memory_gib=20.06&max_model_len=262144`);
    await page.waitForFunction(() => (document.querySelector('[data-testid="planner-result"]')?.textContent || '').includes('164,224'), null, { timeout: LONG });
    await screenshot(page, 'planner.png');
  } finally {
    await b.close();
  }
}

// The lessons (planner steps so far): the list, then lesson 1's figures computed in the page.
async function lessonPages(base) {
  const b = await browser(false);
  try {
    const page = await newPage(b, 'lessons');
    await page.goto(`${base}/lessons`);
    await page.waitForSelector('[data-testid="lesson-list"] li', { timeout: LONG });
    const listed = await page.$$eval('[data-testid="lesson-list"] li', (li) => li.length);
    assert(listed >= 3, `${listed} lessons listed`);
    await page.goto(`${base}/lessons/kv-cache-too-small`);
    await page.waitForSelector('[data-testid="lesson-figure"]', { timeout: LONG });
    const figures = await page.$$eval('[data-testid="lesson-figure"]', (rows) => rows.map((r) => r.textContent));
    assert(figures.some((f) => f.includes('estimated maximum model length') && f.includes('164,224')), `lesson 1's figures: ${figures}`);
    assert(figures.some((f) => f.includes('32.00 GiB')), `the KV one request needs: ${figures}`);
    await page.goto(`${base}/lessons/startup-budget`);
    await page.waitForSelector('[data-testid="lesson-figure"]', { timeout: LONG });
    const budget = (await page.$$eval('[data-testid="lesson-figure"]', (rows) => rows.map((r) => r.textContent))).join(' | ');
    for (const want of ['13.61 GiB', '57.91 GiB', '44.30 GiB', '645,120 tokens']) {
      assert(budget.includes(want), `${want} in lesson 2: ${budget}`);
    }
    await screenshot(page, 'lesson-startup-budget.png');
  } finally {
    await b.close();
  }
}

// The memory view's texts, to compare one state with another.
async function memoryTexts(page) {
  const texts = {};
  for (const id of ['kv-usage', 'encoder-cache-usage', 'processor-cache-usage', 'counters']) {
    texts[id] = (await byTest(page, id).textContent()).trim();
  }
  return texts;
}

// A download the click on `id` starts, read as text.
async function downloaded(page, id) {
  const [download] = await Promise.all([page.waitForEvent('download', { timeout: LONG }), byTest(page, id).click()]);
  const file = await download.path();
  return { file, text: fs.readFileSync(file, 'utf8') };
}

// Each live lesson's checks: `f(step)` is a figure's raw value, `end(step)` the recorded
// occupancy the step ended on (the engine's own counters, ledger and caches).
const LIVE_LESSONS = {
  // Lessons 1-3's halves at tab scale (their full-size steps are checked by lessonPages).
  'kv-cache-too-small': (f, end) => {
    assert(f(0, 'KV blocks') === 8 && end(0).kv.num_blocks === 9, 'the cache shrunk to 8 blocks and the null block');
    assert(f(0, 'the longest request (--max-model-len)') === 128, 'and the longest request with it');
    assert(/exceeds the maximum context length of 128/.test(f.text(1, 'the engine\'s answer')), `the refusal: ${f.text(1, 'the engine\'s answer')}`);
    assert(f(1, 'KV blocks in use') === 0 && end(1).kv.num_in_use === 0, 'a refused request takes no block');
  },
  'startup-budget': (f, end) => {
    // The playground's 256 KV blocks (the null block among them), whole blocks of bytes.
    assert(f(0, 'KV blocks') === 255 && end(0).kv.num_blocks === 256, `KV blocks: ${f(0, 'KV blocks')}`);
    assert(f(0, 'KV cache') % 256 === 0 && f(0, 'weights') > 0, 'the KV cache is whole blocks');
    assert(f(0, 'peak of start-up\'s profile run') > 0, 'a measured profile peak');
  },
  'encoder-budget': (f, end) => {
    // max(--max-num-batched-tokens, largest image) with the playground's 2,048 tokens per step.
    const largest = f(0, 'largest image start-up profiled (tokens)');
    const budget = f(0, 'encoder cache budget (tokens)');
    assert(budget === Math.max(2048, largest) && budget === end(0).encoder_cache.capacity_tokens, `the budget: ${budget}`);
    const items = f(0, 'largest images start-up\'s profile run encoded');
    assert(items >= 1 && items * largest <= budget, `${items} images of ${largest} tokens in ${budget}`);
  },
  'oom-image-29': (f, end) => {
    const profiled = f(0, 'largest image start-up profiled (tokens)');
    assert(f(0, 'the image as kvlens resized it (tokens)') <= profiled, 'step 1 images within the profiled size');
    const own = f(1, 'the image at its own size (tokens)');
    const sent = f(1, 'the image as kvlens resized it (tokens)');
    assert(own >= 4 * sent && sent <= profiled, `image 29: ${own} tokens at its own size, ${sent} sent, ${profiled} profiled`);
    assert(f(1, 'one vision attention layer\'s scores stored in full, at its own size') >= 16 * f(1, 'the same, as resized'), 'scores grow with the square');
    for (const s of [0, 1]) {
      const peak = f(s, 'peak this step (activations, staging, encoder outputs)');
      assert(peak > 0 && peak <= f(s, 'peak of start-up\'s profile run'), `step ${s + 1}'s peak ${peak} within the profiled one`);
    }
    assert(f(1, 'peak this step (activations, staging, encoder outputs)') < f(1, 'the same, as resized'), 'no kernel stores the scores in full');
    const entry = end(1).encoder_cache.entries.at(-1);
    assert(entry && entry.num_tokens === sent, `the encoder cache holds image 29 at ${sent} tokens: ${JSON.stringify(entry)}`);
    assert(end(1).counters.vision_runs - end(0).counters.vision_runs === 1, 'one vision run for image 29');
  },
  'reset-mm-cache': (f, end) => {
    const encoderBytes = (s) => end(s).ledger.find((l) => l.category === 'encoder_cache').bytes;
    assert(f(0, 'processor cache entries') === 1 && end(0).processor_cache.entries.length === 1, 'one preprocessed image');
    assert(f(0, 'encoder cache (device memory)') === encoderBytes(0) && encoderBytes(0) > 0, 'encoder bytes as the ledger holds them');
    assert(f(1, 'processor cache entries') === 0 && end(1).processor_cache.entries.length === 0, '/reset_mm_cache empties the processor cache');
    assert(f(1, 'encoder cache (device memory)') === f(0, 'encoder cache (device memory)') && encoderBytes(1) === encoderBytes(0),
      '/reset_mm_cache leaves the encoder cache\'s bytes unchanged');
    assert(f(1, 'KV blocks cached (free, still found by hash)') === end(1).kv.num_cached_free && end(1).kv.num_cached_free > 0, 'and the cached KV blocks');
    assert(f(2, 'encoder cache (device memory)') === 0 && encoderBytes(2) === 0, '/reset_encoder_cache frees the encoder cache');
    assert(f(3, 'KV blocks cached (free, still found by hash)') === 0 && end(3).kv.num_cached_free === 0, '/reset_prefix_cache forgets the hashes');
    assert(f(3, 'KV blocks') === end(3).kv.num_blocks - 1, 'the KV cache keeps its size');
  },
  'prefix-caching-images': (f, end) => {
    const cached = (s) => end(s).counters.prompt_tokens_cached - end(s - 1).counters.prompt_tokens_cached;
    assert(f(1, 'images through the vision tower') === 0 && f(1, 'prompt tokens found in the prefix cache') > 0, 'the same image hits');
    assert(f(1, 'encoder cache hits') === 1, 'its last tokens from the encoder cache');
    assert(f(1, 'prompt tokens found in the prefix cache') === cached(1), 'hits as the engine counted them');
    assert(f(2, 'images through the vision tower') === 1, 'a different image is encoded');
    const other = f(2, 'prompt tokens found in the prefix cache');
    assert(other > 0 && other < f(1, 'prompt tokens found in the prefix cache') && other === cached(2), `the other image matches only the text before it: ${other}`);
  },
  'preemption': (f, end) => {
    const preempted = f(1, 'preemptions');
    assert(preempted >= 1 && preempted === end(1).counters.num_preemptions - end(0).counters.num_preemptions, `preemptions: ${preempted}`);
    assert(f(3, 'preemptions') === 0, 'none with the whole cache');
    assert(f(3, 'tokens computed again because of preemption') > 0, 'preemption recomputes');
    assert(f(3, 'tokens computed again because of preemption') + f(1, 'prompt tokens found in the prefix cache') >= 16,
      'the preempted request computes again what the prefix cache no longer holds');
    assert(f(3, 'replies token for token the same as the preempted run\'s') === 3, 'the preempted replies equal the undisturbed ones');
  },
};

// Every live lesson in the tab on WebGPU, its figures checked against the recorded timeline; the
// last timeline exported, loaded into a fresh page and replayed to the same final state; the SVG
// opened in Chromium.
async function liveLessons(base) {
  const b = await browser(true);
  try {
    const page = await newPage(b, 'live-lessons');
    let last = null;
    // The first lesson by its URL (which loads the demo model and runs it), the others from the
    // playground's lesson picker on the same model (one load, not seven).
    let first = true;
    for (const [name, checkLesson] of Object.entries(LIVE_LESSONS)) {
      if (first) {
        await page.goto(`${base}/lessons/${name}`);
        first = false;
      } else {
        await byTest(page, 'lesson-pick').selectOption(name);
        await byTest(page, 'run-lesson').click();
      }
      await page.waitForFunction(
        (name) => ['done', 'failed'].includes(
          document.querySelector(`[data-testid="lesson-panel"][data-lesson="${name}"] [data-testid="lesson-status"]`)?.dataset.state),
        name,
        { timeout: LONG },
      );
      const status = await byTest(page, 'lesson-status').textContent();
      assert(status.startsWith('done'), `${name}: ${status}`);
      const steps = await page.$$eval('[data-testid="lesson-panel"] [data-testid="lesson-step"]', (ss) =>
        ss.map((s) => Object.fromEntries([...s.querySelectorAll('[data-testid="lesson-figure"]')]
          .map((r) => [r.dataset.name, { raw: r.dataset.raw, value: r.children[1].textContent }]))));
      const { file, text } = await downloaded(page, 'export-json');
      const timeline = JSON.parse(text);
      const ends = timeline.marks.filter((m) => /^step \d+ done$/.test(m.what)).map((m) => timeline.frames[m.frame - 1]);
      assert(ends.length === steps.length, `${name}: ${ends.length} steps recorded, ${steps.length} shown`);
      const f = (s, fig) => {
        const raw = steps[s][fig]?.raw;
        assert(raw !== undefined && raw !== '', `${name} step ${s + 1} shows no ${fig}: ${JSON.stringify(steps[s])}`);
        return Number(raw);
      };
      f.text = (s, fig) => steps[s][fig]?.value || '';
      checkLesson(f, (s) => ends[s]);
      if (name === 'reset-mm-cache') {
        // The memory view as steps 1 and 2 left it: /reset_mm_cache emptied the processor cache
        // and left the encoder cache's entry.
        await page.locator('[data-testid="lesson-show"]').nth(0).click();
        await page.waitForFunction(() => document.querySelector('[data-testid="shown-step"]')?.textContent.includes('step 1'), null, { timeout: LONG });
        let view = await memoryTexts(page);
        assert(view['processor-cache-usage'].startsWith('1 preprocessed') && view['encoder-cache-usage'].startsWith('1 entry'), `step 1: ${JSON.stringify(view)}`);
        await page.locator('[data-testid="lesson-show"]').nth(1).click();
        await page.waitForFunction(() => document.querySelector('[data-testid="shown-step"]')?.textContent.includes('step 2'), null, { timeout: LONG });
        view = await memoryTexts(page);
        assert(view['processor-cache-usage'].startsWith('0 preprocessed') && view['encoder-cache-usage'].startsWith('1 entry'), `step 2: ${JSON.stringify(view)}`);
        await screenshot(page, 'lesson-reset-mm-cache.png');
        await byTest(page, 'lesson-panel').screenshot({ path: path.join(ARTIFACTS, 'lesson-panel.png'), timeout: 60_000 })
          .catch((e) => console.log(`(screenshot lesson-panel.png not taken: ${String(e).split('\n')[0]})`));
        await page.setViewportSize({ width: 420, height: 900 });
        await screenshot(page, 'lesson-reset-mm-cache-narrow.png');
        const wide = await page.evaluate(() => document.documentElement.scrollWidth);
        assert(wide <= 440, `the lesson page fits a 420-pixel screen: ${wide} pixels wide`);
        await page.setViewportSize({ width: 1400, height: 1000 });
        await page.locator('[data-testid="lesson-show"]').nth(3).click();
      }
      last = { file, texts: await memoryTexts(page) };
    }
    const svg = await downloaded(page, 'export-svg');
    assert(svg.text.startsWith('<svg') && svg.text.includes('<polygon'), 'an SVG plot');
    const svgFile = path.join(ARTIFACTS, 'lesson-timeline.svg');
    fs.writeFileSync(svgFile, svg.text);
    const view = await b.newPage({ viewport: { width: 1200, height: 700 } });
    await view.goto(`file://${svgFile}`);
    const drawn = await view.locator('svg polygon').count();
    assert(drawn === 5, `Chromium draws the SVG's 5 layers (4 caches, activations): ${drawn}`);
    // An SVG document has nothing to settle: a plain screenshot (the helper's full-page one waits
    // for fonts and animations that a file:// SVG never reports).
    await view.screenshot({ path: path.join(ARTIFACTS, 'lesson-timeline.png'), timeout: 60_000 }).catch((e) => console.log(`(screenshot lesson-timeline.png not taken: ${String(e).split('\n')[0]})`));
    // Replayed in a page with no model, the timeline ends where the lesson ended.
    await page.goto(base);
    await byTest(page, 'replay-file').setInputFiles(last.file);
    await page.waitForFunction(() => document.querySelector('[data-testid="replay-status"]')?.textContent.startsWith('replayed'), null, { timeout: LONG });
    const replayed = await memoryTexts(page);
    assert(JSON.stringify(replayed) === JSON.stringify(last.texts), `replayed ${JSON.stringify(replayed)}, recorded ${JSON.stringify(last.texts)}`);
  } finally {
    await b.close();
  }
}

async function playgroundOnCpu(base) {
  const b = await browser(false);
  try {
    const page = await newPage(b, 'cpu');
    await page.goto(`${base}/`);
    await page.waitForFunction(() => !(document.querySelector('[data-testid="device"]')?.textContent ?? 'looking').includes('looking'), null, { timeout: LONG });
    const device = await byTest(page, 'device').textContent();
    assert(device.startsWith('CPU backend'), `WebGPU was off, yet: ${device}`);
    // A plain static server sends no cross-origin-isolation headers: no helper workers.
    assert(device.includes('1 thread (the page is not cross-origin isolated'), `on a page that is not isolated: ${device}`);
    await loadDemo(page);
    // The engine runs in a Web Worker started from the page's own module (a blob: URL).
    const workers = page.workers().map((w) => w.url());
    assert(workers.length === 1 && workers[0].startsWith('blob:'), `the engine's worker: ${JSON.stringify(workers)}`);
    sameTokens(await ask(page, 0), 'CPU fallback');
    // The page's longest main-thread task while the CPU fallback reads a new 512×512 image (no
    // cache holds it: 256 image tokens) and replies: preprocessing and every step run in the
    // worker, the page only draws tokens and occupancy. Reported, not asserted (a timing). The
    // reply above has already made Chromium look up the fallback fonts of the random demo model's
    // Cyrillic and CJK tokens, a one-off layout task that is not the engine's.
    await byTest(page, 'new-conversation').click();
    await page.evaluate(() => {
      window.__longestTask = 0;
      new PerformanceObserver((list) => {
        for (const e of list.getEntries()) window.__longestTask = Math.max(window.__longestTask, e.duration);
      }).observe({ type: 'longtask' });
    });
    await ask(page, 0, LARGE_IMAGE);
    const longest = await page.evaluate(() => window.__longestTask);
    console.log(`    longest main-thread task while the CPU fallback read a new 512×512 image and replied: ${longest.toFixed(0)} ms (0: none over 50 ms)`);
  } finally {
    await b.close();
  }
}

// Server mode: the page (from `site`) watches `server` through the server panel's views.
async function watch(page, server, want) {
  await byTest(page, 'mode-server').click();
  await byTest(page, 'server-url').fill(server);
  await byTest(page, 'server-connect').click();
  await page.waitForFunction(
    (want) => (document.querySelector('[data-testid="server-status"]')?.textContent || '').includes(want),
    want,
    { timeout: LONG },
  );
}

const inServer = (page, id) => page.locator(`.server-mode [data-testid="${id}"]`);

async function serverModeOnKvlens(site, served) {
  const b = await browser(true);
  try {
    const page = await newPage(b, 'server-kvlens');
    await page.goto(`${site}/`);
    await watch(page, served, 'connected to kvlens serve');
    const image = fs.readFileSync(IMAGE).toString('base64');
    const r = await fetch(`${served}/v1/chat/completions`, {
      method: 'POST',
      headers: { 'content-type': 'application/json' },
      body: JSON.stringify({
        model: 'kvlens-demo',
        messages: [{ role: 'user', content: [
          { type: 'image_url', image_url: { url: `data:image/png;base64,${image}` } },
          { type: 'text', text: PROMPT },
        ] }],
        max_tokens: Number(MAX_TOKENS),
        temperature: 0,
      }),
    });
    assert(r.status === 200, `the chat request to kvlens serve answered ${r.status}: ${await r.text()}`);
    await page.waitForFunction(
      () => (document.querySelector('.server-mode [data-testid="encoder-cache-usage"]')?.textContent || '').startsWith('1 entry'),
      null,
      { timeout: LONG },
    );
    // The finished request's blocks come back in a later event than the one with the entry.
    await page.waitForFunction(
      () => /^0\/\d+ blocks$/.test(document.querySelector('.server-mode [data-testid="kv-usage"]')?.textContent || ''),
      null,
      { timeout: LONG },
    );
    await screenshot(page, 'server-mode-kvlens.png');
    await inServer(page, 'reset-encoder-cache').click();
    await page.waitForFunction(
      () => (document.querySelector('.server-mode [data-testid="encoder-cache-usage"]')?.textContent || '').startsWith('0 entries'),
      null,
      { timeout: LONG },
    );
  } finally {
    await b.close();
  }
}

// Server mode on a hybrid model: the state slots are drawn beside the KV grid, one is held while a
// request streams, and it comes back when the client goes away mid-stream.
async function serverModeOnHybrid(site, served) {
  const b = await browser(true);
  let page;
  const stateUsage = (re) => page.waitForFunction(
    (src) => new RegExp(src).test(document.querySelector('.server-mode [data-testid="state-usage"]')?.textContent || ''),
    re.source,
    { timeout: LONG },
  );
  try {
    page = await newPage(b, 'server-hybrid');
    await page.goto(`${site}/`);
    await watch(page, served, 'connected to kvlens serve');
    await stateUsage(/^0\/\d+ slots · /);
    const models = await (await fetch(`${served}/v1/models`)).json();
    const abort = new AbortController();
    const r = await fetch(`${served}/v1/chat/completions`, {
      method: 'POST',
      headers: { 'content-type': 'application/json' },
      signal: abort.signal,
      body: JSON.stringify({
        model: models.data[0].id,
        messages: [{ role: 'user', content: PROMPT }],
        max_tokens: 3000,
        ignore_eos: true,
        temperature: 0,
        stream: true,
      }),
    });
    assert(r.status === 200, `the streaming request answered ${r.status}`);
    const reader = r.body.getReader();
    await reader.read();
    await stateUsage(/^1\/\d+ slots · /);
    await screenshot(page, 'server-mode-hybrid.png');
    abort.abort();
    await reader.cancel().catch(() => {});
    await stateUsage(/^0\/\d+ slots · /);
    await page.waitForFunction(
      () => /^0\/\d+ blocks$/.test(document.querySelector('.server-mode [data-testid="kv-usage"]')?.textContent || ''),
      null,
      { timeout: LONG },
    );
  } finally {
    await b.close();
  }
}

async function fakeVllm() {
  const { port, child } = await startListening(
    PYTHON,
    [path.join(HERE, 'fake_vllm.py'), '--port', '0', '--advance'],
    'fake-vllm',
    /fake vLLM metrics on http:\/\/[^\s]*:(\d+)\//,
  );
  const base = `http://127.0.0.1:${port}`;
  await waitHttp(`${base}/metrics`, child, 'fake-vllm');
  return base;
}

async function serverModeOnVllm(site, vllm) {
  const b = await browser(true);
  try {
    const page = await newPage(b, 'server-vllm');
    await page.goto(`${site}/`);
    await watch(page, vllm, 'connected to vLLM metrics');
    await page.waitForFunction(
      () => /^\d+\/\d+ blocks/.test(document.querySelector('.server-mode [data-testid="kv-usage"]')?.textContent || ''),
      null,
      { timeout: LONG },
    );
    const missing = await inServer(page, 'vllm-not-exposed').textContent();
    assert(missing.includes('encoder'), `the page does not say vLLM hides the encoder cache: ${missing}`);
    await screenshot(page, 'server-mode-vllm.png');
  } finally {
    await b.close();
  }
}

// The fake vLLM event publisher (on the given ports, or free ones): its endpoints and `send(cmd)`,
// which resolves once it has published.
async function fakeVllmEvents(ports = [0, 0, 0]) {
  const { child } = await startListening(
    CLIENT_PYTHON,
    [path.join(HERE, 'fake_vllm_events.py'), '--events-port', String(ports[0]), '--replay-port', String(ports[1]),
      '--metrics-port', String(ports[2])],
    'fake-vllm-events',
    /fake vLLM events on tcp:\/\/[^\s]*:(\d+) /,
    'pipe',
  );
  let out = '';
  child.stdout.on('data', (c) => { out += c.toString(); });
  // The line was printed before the listener above saw it; read the log for the three ports.
  const log = () => fs.readFileSync(path.join(ARTIFACTS, 'fake-vllm-events.log'), 'utf8');
  let m;
  for (let i = 0; i < 100 && !(m = /on tcp:\/\/127\.0\.0\.1:(\d+) replay tcp:\/\/127\.0\.0\.1:(\d+) metrics http:\/\/127\.0\.0\.1:(\d+)\//.exec(log())); i++) {
    await new Promise((r) => setTimeout(r, 50));
  }
  assert(m, `the fake publisher's ports: ${log()}`);
  let sent = 0;
  const send = async (cmd) => {
    sent += 1;
    const want = sent;
    child.stdin.write(`${cmd}\n`);
    const deadline = Date.now() + LONG;
    while ((out.match(/^done /gm) || []).length < want) {
      assert(Date.now() < deadline && child.exitCode === null, `the fake publisher did not do ${cmd}`);
      await new Promise((r) => setTimeout(r, 20));
    }
  };
  return {
    child, send, ports: [m[1], m[2], m[3]],
    events: `tcp://127.0.0.1:${m[1]}`, replay: `tcp://127.0.0.1:${m[2]}`, metrics: `http://127.0.0.1:${m[3]}`,
  };
}

// Waits until the watch grid draws `blocks` cells, `images` of them blue.
async function watchGrid(page, blocks, images) {
  await page.waitForFunction(
    ([n, k]) => document.querySelectorAll('.server-mode [data-testid="watch-block"]').length === n
      && document.querySelectorAll('.server-mode [data-testid="watch-block"].image').length === k,
    [blocks, images],
    { timeout: LONG },
  );
}

const watchCounts = (page) => inServer(page, 'watch-counts').textContent();

async function watchOnVllmEvents() {
  let fake = await fakeVllmEvents();
  await fake.send('store 8');
  const { port } = await startListening(
    KVLENS,
    ['watch', '--events', fake.events, '--replay', fake.replay, '--topic', 'kv-events', '--metrics', fake.metrics,
      '--playground-dir', DIST, '--port', '0',
      '--model', 'Qwen3-VL-8B-Instruct', '--gpu-memory-utilization', '0.92', '--max-model-len', '32768'],
    'kvlens-watch',
    /Watch page on http:\/\/[^\s]*:(\d+)/,
  );
  const site = `http://127.0.0.1:${port}`;
  const b = await browser(false);
  try {
    const page = await newPage(b, 'watch-vllm');
    await page.goto(`${site}/`);
    await watch(page, site, 'connected to kvlens watch');
    // Stored before the watch started: caught up through the replay socket.
    await watchGrid(page, 8, 0);
    await fake.send('store 4 image');
    await watchGrid(page, 12, 4);
    const oldest = await page.$$eval('.server-mode [data-testid="watch-block"]', (cells) => cells.slice(0, 3).map((c) => c.dataset.hash));
    await fake.send('remove 3');
    await watchGrid(page, 9, 4);
    const left = await page.$$eval('.server-mode [data-testid="watch-block"]', (cells) => cells.map((c) => c.dataset.hash));
    assert(oldest.every((h) => !left.includes(h)), `removed blocks still drawn: ${oldest} in ${left}`);
    // A batch lost on the way: the next one shows the gap and the replay fills it.
    await fake.send('gap');
    await fake.send('store 2');
    await fake.send('store 1');
    await watchGrid(page, 12, 4);
    const counts = await watchCounts(page);
    assert(/replayed 2 · lost 0/.test(counts), `one batch at the start and one after the gap replayed: ${counts}`);
    // The planner beside the server: 0.92 agrees, the server's blocks fall short of the plan.
    await page.waitForFunction(
      () => (document.querySelector('.server-mode [data-testid="watch-findings"]')?.textContent || '').includes('KV blocks per engine'),
      null,
      { timeout: LONG },
    );
    const findings = await inServer(page, 'watch-findings').textContent();
    assert(/--gpu-memory-utilization0\.920\.92agree/.test(findings), `the share agrees: ${findings}`);
    assert(/KV blocks per engine2392022150differ: .*CUDA-graph/.test(findings), `the blocks differ: ${findings}`);
    assert(/weights per engine16\.52 GiB16\.52 GiBagree/.test(findings), `the weights agree: ${findings}`);
    const usage = await inServer(page, 'kv-usage').textContent();
    assert(/^\d+\/22150 blocks$/.test(usage), `the server's usage: ${usage}`);
    await screenshot(page, 'watch-vllm-events.png');
    // The publisher restarts on the same ports: its new blocks replace the old ones.
    fake.child.kill('SIGKILL');
    await new Promise((r) => fake.child.exitCode !== null ? r() : fake.child.on('exit', r));
    fake = await fakeVllmEvents(fake.ports);
    let stores = 0;
    const deadline = Date.now() + LONG;
    while (!/restarts 1/.test(await watchCounts(page))) {
      assert(Date.now() < deadline, `no restart seen: ${await watchCounts(page)}`);
      await fake.send('store 1');
      stores += 1;
      await new Promise((r) => setTimeout(r, 300));
    }
    await watchGrid(page, stores, 0);
  } finally {
    await b.close();
  }
}

(async () => {
  fs.mkdirSync(ARTIFACTS, { recursive: true });
  try {
    const served = await kvlensServe('kvlens-serve');
    await check('playground on WebGPU, served by kvlens serve', () => playgroundOnWebGpu(served));
    await check('playground on WebGPU with q4_0 weights', () => playgroundQuantized(served, true));
    await check('playground on WebGPU, a GGUF pair by URL (range requests)', () => playgroundGguf(served, true, { ranged: true }));
    await check('playground on WebGPU, a GGUF pair from disk, then its text model alone', () => playgroundGguf(served, true, { fromDisk: true }));
    await check('planner link shows 164,224', () => plannerLink(served));
    await check('lessons 1-3 show the seeds\' figures', () => lessonPages(served));
    await check('lessons run in the tab (1-3 at tab scale, 4-7), their figures checked against the recorded counters; replay; SVG', () => liveLessons(served));
    const site = await staticServer('static-server');
    await check('playground on the CPU backend (WebGPU off), static dist/', () => playgroundOnCpu(site));
    await check('playground on the CPU backend with q4_0 weights', () => playgroundQuantized(site, false));
    await check('playground on the CPU backend with q4_0 weights at 2 threads (the helpers\' rows not held twice)', () => playgroundQuantized(served, false, 2));
    await check('playground on the CPU backend, a GGUF pair by URL (a server without ranges)', () => playgroundGguf(site, false));
    await check('playground on the CPU backend, a GGUF pair by URL kept in Cache Storage: the reload reads it from there', () => playgroundGgufKept(site));
    await check('playground on the CPU backend at 2 threads (helper workers; kvlens serve isolates the page), a GGUF pair by URL', () => playgroundGguf(served, false, { threads: 2 }));
    await check('server mode: a kvlens serve on another origin', () => serverModeOnKvlens(site, served));
    const hybrid = await kvlensServe('kvlens-serve-hybrid', ['--model', HYBRID]);
    await check('server mode: a hybrid model\'s state slots fill while a request streams and empty when its client leaves', () => serverModeOnHybrid(site, hybrid));
    const vllm = await fakeVllm();
    await check('server mode: a vLLM /metrics endpoint', () => serverModeOnVllm(site, vllm));
    await check('kvlens watch: a vLLM KV event stream (replay, restart) and the plan beside it', watchOnVllmEvents);
  } catch (e) {
    failures += 1;
    console.log(`e2e setup FAILED\n${e.stack || e}`);
  } finally {
    for (const c of children) c.kill('SIGTERM');
  }
  console.log(`e2e: ${passes} passed, ${failures} failed (artifacts in ${ARTIFACTS})`);
  process.exit(failures ? 1 : 0);
})();
