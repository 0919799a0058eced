"use strict";
// The playground: the server's own API from this page (no library, nothing fetched from elsewhere). Event streams
// are read with fetch() and a ReadableStream, not EventSource, which cannot send the bearer token.
(() => {
  const config = JSON.parse(document.getElementById("h3-config").textContent);
  const base = location.pathname.replace(/\/+$/, ""); // the application's route prefix ("" at /)
  const $ = (id) => document.getElementById(id);
  const cards = new Map(); // video id -> {el, following, video}
  let key = config.auth ? sessionStorage.getItem("h3serve-key") || "" : "";

  function headers(extra) {
    const all = Object.assign({}, extra || {});
    if (key) all.Authorization = "Bearer " + key;
    return all;
  }

  async function api(path, options) {
    options = options || {};
    const response = await fetch(base + path, Object.assign({}, options, { headers: headers(options.headers) }));
    if (!response.ok) {
      let message = response.statusText;
      try { message = (await response.json()).error.message; } catch (e) { /* not JSON */ }
      const error = new Error(response.status + ": " + message);
      error.status = response.status;
      throw error;
    }
    return response;
  }

  const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));
  const eta = (s) => (s === null || s === undefined ? "" : " · ETA " + (s < 60 ? s.toFixed(1) + " s" : Math.round(s / 60) + " min"));

  // -- auth -------------------------------------------------------------------------------------
  function showAuth() {
    const state = $("auth-state");
    if (!config.auth) {
      state.textContent = "open server: no key needed";
      return;
    }
    $("key-form").hidden = false;
    state.textContent = key ? "key set" : "this server needs an API key";
  }

  $("key-form").addEventListener("submit", (e) => {
    e.preventDefault();
    key = $("key").value.trim();
    sessionStorage.setItem("h3serve-key", key);
    $("key").value = "";
    showAuth();
    start();
  });

  // whose key it is (a tenant sees its own jobs; an admin every job)
  async function loadMe() {
    const me = await (await api("/v1/me")).json();
    const tenant = $("tenant");
    tenant.hidden = !me.auth;
    tenant.textContent = me.auth ? "tenant " + me.name + (me.role === "admin" ? " (admin: every job)" : "") : "";
  }

  // -- models and the form ----------------------------------------------------------------------
  async function loadModels() {
    const models = (await (await api("/v1/models")).json()).data;
    const model = $("model"), cache = $("cache");
    model.replaceChildren(...models.map((m) => new Option(m.parent ? m.id + " (adapter)" : m.id, m.id)));
    const base = models[0];
    cache.replaceChildren(...base.cache_tiers.map((t) => new Option(t === base.cache_default ? t + " (default)" : t, t)));
    cache.value = base.cache_default;
    $("model-name").textContent = base.id;
  }

  $("create").addEventListener("submit", async (e) => {
    e.preventDefault();
    $("form-error").textContent = "";
    const form = new FormData();
    form.set("prompt", $("prompt").value);
    for (const [id, name] of [["seconds", "seconds"], ["size", "size"], ["steps", "num_inference_steps"], ["priority", "priority"]]) {
      if ($(id).value !== "") form.set(name, $(id).value);
    }
    if ($("model").value) form.set("model", $("model").value);
    if ($("cache").value) form.set("cache", $("cache").value);
    if ($("first-frame").files[0]) form.set("input_reference", $("first-frame").files[0]);
    if ($("last-frame").files[0]) form.set("last_reference", $("last-frame").files[0]);
    $("submit").disabled = true;
    try {
      const video = await (await api("/v1/videos", { method: "POST", body: form })).json();
      card(video, true);
      follow(video.id);
    } catch (error) {
      $("form-error").textContent = error.message;
    } finally {
      $("submit").disabled = false;
    }
  });

  // -- job cards --------------------------------------------------------------------------------
  function card(video, first) {
    let entry = cards.get(video.id);
    if (!entry) {
      const el = $("card-template").content.firstElementChild.cloneNode(true);
      el.id = "job-" + video.id;
      el.dataset.previews = "0";
      el.querySelector(".prompt").textContent = video.prompt;
      el.querySelector(".prompt").title = video.prompt;
      el.querySelector(".meta").textContent = `${video.id} · ${video.seconds} s · ${video.size} · ${video.model}`;
      el.querySelector(".cancel").addEventListener("click", () => cancel(video.id));
      entry = { el, following: false, video, previews: new Set() };
      cards.set(video.id, entry);
      const jobs = $("jobs");
      first ? jobs.prepend(el) : jobs.append(el);
    }
    update(entry, video);
    return entry;
  }

  function update(entry, video) {
    entry.video = Object.assign(entry.video, video);
    const v = entry.video, el = entry.el;
    el.dataset.status = v.status;
    el.querySelector(".status").textContent = v.status.replace("_", " ");
    el.querySelector(".cancel").hidden = !(v.status === "queued" || v.status === "in_progress");
    if (v.status === "queued") {
      el.querySelector(".detail").textContent =
        (v.queue_position ? "position " + v.queue_position + " in the queue" : "queued") + eta(v.eta_seconds);
    } else if (v.status === "completed") {
      el.querySelector(".progress, progress").value = 100;
      el.querySelector(".detail").textContent = "done";
      showVideo(entry);
    } else if (v.status === "failed") {
      el.querySelector(".detail").textContent = "failed: " + (v.error ? v.error.message : "unknown error");
    } else if (v.status === "cancelled") {
      el.querySelector(".detail").textContent = "cancelled";
    } else if (v.progress !== undefined) {
      el.querySelector("progress").value = v.progress;
    }
  }

  function onEvent(entry, kind, data) {
    const el = entry.el, detail = el.querySelector(".detail");
    if (kind === "queued") {
      update(entry, { status: "queued", queue_position: data.position, eta_seconds: data.eta_s });
    } else if (kind === "started") {
      update(entry, { status: "in_progress" });
      detail.textContent = "started";
    } else if (kind === "step") {
      update(entry, { status: "in_progress", progress: Math.round((100 * data.step) / data.steps) });
      detail.textContent = `step ${data.step} of ${data.steps}` + eta(data.eta_s);
    } else if (kind === "progress") { // from the job's record (another ingress runs it)
      update(entry, { status: "in_progress", progress: data.progress });
      detail.textContent = `${data.progress}%` + eta(data.eta_s);
    } else if (kind === "preview") {
      const img = el.querySelector(".preview");
      img.src = data.image;
      img.hidden = false;
      entry.previews.add(data.image);
      el.dataset.previews = String(entry.previews.size); // distinct previews shown so far
    } else if (kind === "decoding") {
      detail.textContent = "decoding" + eta(data.eta_s);
      if (data.streamed) playStream(entry); // a decode split over ranks or a decoder stage sends the clip whole
    } else if (kind === "completed" || kind === "failed" || kind === "cancelled") {
      if (data.video) update(entry, Object.assign({}, data.video, { status: kind }));
      return true;
    }
    return false;
  }

  // Server-Sent Events over fetch(): resumes after the last id it saw when the connection drops
  async function follow(id) {
    const entry = cards.get(id);
    if (!entry || entry.following) return;
    entry.following = true;
    let lastId = "";
    try {
      for (let attempt = 0; attempt < 50; attempt++) {
        try {
          const response = await api(`/v1/videos/${id}/events`, { headers: lastId ? { "Last-Event-ID": lastId } : {} });
          const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
          let buffer = "";
          for (;;) {
            const { value, done } = await reader.read();
            if (done) break;
            buffer += value;
            let end;
            while ((end = buffer.indexOf("\n\n")) >= 0) {
              const block = buffer.slice(0, end);
              buffer = buffer.slice(end + 2);
              let kind = "", data = "", eventId = "";
              for (const line of block.split("\n")) {
                if (line.startsWith("event: ")) kind = line.slice(7);
                else if (line.startsWith("data: ")) data += line.slice(6);
                else if (line.startsWith("id: ")) eventId = line.slice(4);
              }
              if (eventId) lastId = eventId;
              if (kind && onEvent(entry, kind, JSON.parse(data))) return;
            }
          }
        } catch (error) {
          if (error.status && error.status < 500) return; // the job is gone, or the key is wrong
        }
        await sleep(2000);
      }
    } finally {
      entry.following = false;
    }
  }

  async function cancel(id) {
    const entry = cards.get(id);
    try {
      update(entry, await (await api(`/v1/videos/${id}/cancel`, { method: "POST" })).json());
    } catch (error) {
      entry.el.querySelector(".detail").textContent = error.message;
    }
  }

  // While the job decodes, its content is a fragmented MP4 made as the decode goes: fetched as a stream and appended
  // to a MediaSource, so the <video> plays from the first chunk. Where the browser cannot (no MediaSource, or not
  // these codecs), or the stream breaks, the finished MP4 is shown when the job completes, as before.
  const STREAM_TYPE = 'video/mp4; codecs="avc1.64001f, mp4a.40.2"';

  async function playStream(entry) {
    if (entry.streaming || entry.loading || !window.MediaSource || !MediaSource.isTypeSupported(STREAM_TYPE)) return;
    entry.streaming = true;
    const el = entry.el, video = el.querySelector(".clip");
    try {
      const response = await api(`/v1/videos/${entry.video.id}/content`);
      if (response.headers.get("X-H3serve-Stream") !== "fragmented-mp4") return; // finished already: showVideo's
      const source = new MediaSource(), streamUrl = URL.createObjectURL(source);
      video.src = streamUrl;
      video.hidden = false;
      await new Promise((resolve) => source.addEventListener("sourceopen", resolve, { once: true }));
      // plays as soon as the first frames are in (once: a pause by the viewer stays a pause)
      video.addEventListener("canplay", () => {
        if (video.src !== streamUrl) return; // the finished MP4 took its place first
        video.play().then(() => { el.dataset.streamPlayed = "1"; }, () => { /* autoplay refused: the controls */ });
      }, { once: true });
      const buffer = source.addSourceBuffer(STREAM_TYPE);
      const reader = response.body.getReader();
      let bytes = 0;
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        await new Promise((resolve, reject) => {
          buffer.addEventListener("updateend", resolve, { once: true });
          buffer.addEventListener("error", reject, { once: true });
          buffer.appendBuffer(value);
        });
        bytes += value.length;
        el.dataset.streamBytes = String(bytes);
      }
      source.endOfStream();
      el.dataset.streamed = "1";
      if (entry.finished) swapWhenIdle(entry);
    } catch (error) {
      entry.streaming = false; // the finished MP4 replaces it when the job completes (or now, if it has)
      el.dataset.streamError = error.message || String(error);
      if (entry.finished) show(entry);
    }
  }

  // The finished MP4 in place of the stream (the same frames and sound; its exact duration, seekable) once the
  // stream has ended and the clip is not playing (it ended, or was paused): a swap never interrupts playback
  function swapWhenIdle(entry) {
    const video = entry.el.querySelector(".clip");
    if (entry.el.dataset.streamed !== "1") return; // still streaming: its end calls again
    if (video.paused || video.ended) show(entry);
    else for (const idle of ["ended", "pause"]) video.addEventListener(idle, () => show(entry), { once: true });
  }

  function show(entry) {
    const video = entry.el.querySelector(".clip");
    if (video.src !== entry.finished) video.src = entry.finished;
    entry.el.dataset.clip = "finished";
  }

  // the MP4 through fetch (the token goes in a header), shown from a blob: URL, which the download link saves too
  async function showVideo(entry) {
    if (entry.loading) return;
    entry.loading = true;
    const el = entry.el, id = entry.video.id;
    try {
      const blob = await (await api(`/v1/videos/${id}/content`)).blob();
      const url = URL.createObjectURL(blob);
      const video = el.querySelector(".clip");
      entry.finished = url;
      if (entry.streaming) swapWhenIdle(entry);
      else show(entry);
      video.hidden = false;
      const link = el.querySelector(".download");
      link.href = url;
      link.download = id + ".mp4";
      link.hidden = false;
    } catch (error) {
      el.querySelector(".detail").textContent = "the video could not be loaded: " + error.message;
      entry.loading = false;
    }
  }

  async function loadJobs() {
    const videos = (await (await api("/v1/videos?limit=20")).json()).data;
    for (const video of videos.slice().reverse()) {
      const entry = card(video, true);
      if (video.status === "queued" || video.status === "in_progress") follow(video.id);
    }
  }

  // -- the live panel ---------------------------------------------------------------------------
  async function refreshStats() {
    try {
      const s = await (await api("/v1/stats")).json();
      const r = s.replica; // null: no replica runs (scaled to zero), and this poll does not start one
      $("stat-queue").textContent = r ? `${r.waiting} waiting, ${r.active} active` : "no replica running";
      $("stat-duty").textContent = r ? (100 * r.duty_cycle).toFixed(0) + "%" : "-";
      $("stat-rate").textContent = r && r.row_step_rate ? Math.round(r.row_step_rate).toLocaleString() : "-";
      $("stat-cancelled").textContent = r ? Object.values(r.cancelled).reduce((a, b) => a + b, 0) : "-";
      $("stat-admission").textContent = s.admission_failures === null ? "unknown" : s.admission_failures;
      $("stat-streams").textContent = s.event_streams_open;
      $("stat-error").textContent = "";
    } catch (error) {
      $("stat-error").textContent = error.message;
    }
  }

  let started = false;
  async function start() {
    if (config.auth && !key) return;
    try {
      await loadModels();
      await loadMe();
      await loadJobs();
      document.body.dataset.ready = "1"; // the models and the job list are in
    } catch (error) {
      $("form-error").textContent = error.status === 401 ? "the key was refused: set it again" : error.message;
      return;
    }
    if (started) return;
    started = true;
    refreshStats();
    setInterval(refreshStats, 2000);
    setInterval(() => loadJobs().catch(() => {}), 5000);
  }

  showAuth();
  start();
})();
