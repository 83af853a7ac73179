//! Where the playground's checkpoint comes from: a base URL (the bundled demo model, a local static
//! server, a Hugging Face `resolve/main/` URL), a llama.cpp GGUF pair's two URLs, or files picked
//! from disk (a checkpoint folder's files, or a GGUF pair). Small files are read whole; a GGUF
//! file's header is read first, by range requests (a growing prefix, until it holds the header),
//! so the planner's verdict counts its tensors as stored before any weight is fetched. Weight files
//! are handed over chunk by chunk, so a checkpoint is never held whole in wasm memory. What was
//! fetched whole is kept in Cache Storage, so a reload does not download it again.

use crate::cache_copy::CacheCopy;
use js_sys::{Reflect, Uint8Array};
use kvlens_engine::arch::config::ModelConfig;
use kvlens_engine::arch::gguf::Gguf;
use kvlens_engine::arch::gguf_model::GgufModel;
use kvlens_engine::input::chat::select_chat_template;
use kvlens_engine::model::checkpoint_files;
use wasm_bindgen::{JsCast, JsValue};
use wasm_bindgen_futures::JsFuture;
use web_sys::{Blob, Cache, File, Headers, ReadableStreamDefaultReader, RequestInit, Response};

/// The Cache Storage bucket fetched checkpoint files are kept in.
const CACHE_NAME: &str = "kvlens-checkpoints";

/// Bytes read from a picked file at a time.
const FILE_CHUNK: f64 = 4.0 * 1024.0 * 1024.0;

/// The first bytes read of a GGUF file for its header, four times more each time they fall short
/// (a Qwen text model's vocabulary and merges make its header about 6 MiB).
const HEADER_FIRST: u64 = 8 << 20;

/// The most read for a GGUF header: a header that claims more (a lying count) is refused before
/// the page holds the file.
const HEADER_MAX: u64 = 128 << 20;

/// Where the files are.
#[derive(Clone, Debug)]
pub enum Source {
    /// A checkpoint folder's URL.
    Url(String),
    /// A llama.cpp GGUF text model's URL and its projector's (`mmproj-*.gguf`).
    GgufUrls {
        /// The text model.
        model: String,
        /// The projector; None for the text model alone (it takes no images).
        mmproj: Option<String>,
    },
    /// Files picked from disk (a folder or several files), found by name.
    Files(Vec<File>),
}

/// A GGUF file of a pair: its name (a URL, or a picked file's name), length and header.
#[derive(Debug, Clone)]
pub struct GgufFile {
    /// What [`Source::stream`] reads it by.
    pub name: String,
    /// Bytes in the file.
    pub len: u64,
    /// Its header.
    pub header: Gguf,
}

/// The files the weights are in.
#[derive(Debug, Clone)]
pub enum Weights {
    /// Safetensors shards in load order, with their sizes when known before reading (picked
    /// files).
    Safetensors(Vec<(String, Option<u64>)>),
    /// A GGUF text model and its projector.
    Gguf {
        /// The text model.
        text: GgufFile,
        /// The projector; None for the text model alone.
        mmproj: Option<GgufFile>,
    },
}

impl Weights {
    /// The bytes of the tensors as stored, when the headers say (GGUF): what the planner counts.
    pub fn stored_bytes(&self) -> Option<u64> {
        match self {
            Weights::Safetensors(_) => None,
            Weights::Gguf { text, mmproj } => gguf_model(text, mmproj.as_ref()).ok().map(|m| m.stored_bytes()),
        }
    }
}

/// A GGUF text model's and its projector's headers read as one model.
pub fn gguf_model<'a>(text: &'a GgufFile, mmproj: Option<&'a GgufFile>) -> Result<GgufModel<'a>, String> {
    GgufModel::new(&text.header, mmproj.map(|m| &m.header)).map_err(|e| pair_error(text, mmproj, e))
}

/// An error about a GGUF text model and its projector, naming both files.
fn pair_error(text: &GgufFile, mmproj: Option<&GgufFile>, e: impl std::fmt::Display) -> String {
    match mmproj {
        Some(m) => format!("{} with {}: {e}", text.name, m.name),
        None => format!("{}: {e}", text.name),
    }
}

/// The small files of a checkpoint, read before any weight.
#[derive(Debug, Clone)]
pub struct CheckpointInfo {
    /// config.json, parsed.
    pub config: ModelConfig,
    /// tokenizer.json.
    pub tokenizer_json: Vec<u8>,
    /// The chat template (chat_template.jinja, chat_template.json or tokenizer_config.json).
    pub chat_template: String,
    /// preprocessor_config.json, when present.
    pub preprocessor_json: Option<String>,
    /// End-of-sequence ids (generation_config.json's, else the config's).
    pub eos: Vec<u32>,
    /// The weight files.
    pub weights: Weights,
}

fn js_error(what: &str, e: JsValue) -> String {
    let text = e
        .dyn_ref::<js_sys::Error>()
        .map(|e| String::from(e.message()))
        .or_else(|| e.as_string())
        .unwrap_or_else(|| format!("{e:?}"));
    format!("{what}: {text}")
}

/// The engine worker's scope (checkpoints are fetched there) and the Cache Storage bucket, when
/// the browser offers one.
async fn worker_cache() -> Result<(web_sys::WorkerGlobalScope, Option<Cache>), String> {
    let scope: web_sys::WorkerGlobalScope = js_sys::global()
        .dyn_into()
        .map_err(|_| "checkpoints are fetched in the engine's worker")?;
    let cache = match scope.caches() {
        Ok(storage) => JsFuture::from(storage.open(CACHE_NAME))
            .await
            .ok()
            .map(|c| c.unchecked_into()),
        Err(_) => None,
    };
    Ok((scope, cache))
}

/// The response Cache Storage holds for `url`, if any.
async fn cached(cache: Option<&Cache>, url: &str) -> Option<Response> {
    let hit = JsFuture::from(cache?.match_with_str(url)).await.ok()?;
    hit.dyn_into::<Response>().ok()
}

/// A fetched file: its response, and its copy into Cache Storage when it came from the network.
struct Fetched {
    response: Response,
    copy: Option<CacheCopy>,
}

impl Fetched {
    /// Reads the body chunk by chunk into `each`, copying each chunk into Cache Storage on the way.
    async fn read(self, name: &str, mut each: impl FnMut(&[u8]) -> Result<(), String>) -> Result<(), String> {
        let body = self.response.body().ok_or_else(|| format!("{name}: empty response"))?;
        let reader: ReadableStreamDefaultReader = body.get_reader().unchecked_into();
        loop {
            let chunk = JsFuture::from(reader.read()).await.map_err(|e| js_error(name, e))?;
            if Reflect::get(&chunk, &"done".into()).ok().and_then(|d| d.as_bool()) != Some(false) {
                break;
            }
            let value: Uint8Array = Reflect::get(&chunk, &"value".into())
                .map_err(|e| js_error(name, e))?
                .unchecked_into();
            each(&value.to_vec())?;
            if let Some(copy) = &self.copy {
                copy.write(&value).await;
            }
        }
        if let Some(copy) = self.copy {
            copy.finish();
        }
        Ok(())
    }
}

/// The file at `url`, from Cache Storage when it holds it, else fetched (and copied there while it
/// is read; a cache that refuses, e.g. over quota, only costs the next reload); None on HTTP 404.
async fn fetch_cached(url: &str) -> Result<Option<Fetched>, String> {
    let (scope, cache) = worker_cache().await?;
    if let Some(response) = cached(cache.as_ref(), url).await {
        return Ok(Some(Fetched { response, copy: None }));
    }
    let response: Response = JsFuture::from(scope.fetch_with_str(url))
        .await
        .map_err(|e| js_error(&format!("fetching {url}"), e))?
        .unchecked_into();
    match response.status() {
        200 => {}
        404 => return Ok(None),
        s => return Err(format!("fetching {url}: HTTP {s}")),
    }
    let copy = cache.and_then(|cache| CacheCopy::start(&cache, url, &response));
    Ok(Some(Fetched { response, copy }))
}

/// A header's value, when the response has it and the page may read it.
fn header(response: &Response, name: &str) -> Option<String> {
    response.headers().get(name).ok().flatten()
}

/// Up to `limit` bytes of `response`'s body from its start (the rest is not read).
async fn body_prefix(response: &Response, limit: u64, what: &str) -> Result<Vec<u8>, String> {
    let body = response.body().ok_or_else(|| format!("{what}: empty response"))?;
    let reader: ReadableStreamDefaultReader = body.get_reader().unchecked_into();
    let mut out = Vec::new();
    while (out.len() as u64) < limit {
        let chunk = JsFuture::from(reader.read()).await.map_err(|e| js_error(what, e))?;
        if Reflect::get(&chunk, &"done".into()).ok().and_then(|d| d.as_bool()) != Some(false) {
            break;
        }
        let value = Reflect::get(&chunk, &"value".into()).map_err(|e| js_error(what, e))?;
        let take = (limit - out.len() as u64).min(u64::from(Uint8Array::new(&value).length())) as u32;
        out.extend(Uint8Array::new(&value).subarray(0, take).to_vec());
    }
    let _ = reader.cancel();
    Ok(out)
}

/// The first `limit` bytes of the file at `url` and its length: from Cache Storage when it holds
/// the whole file, else by a range request (a server that ignores the range sends the whole file,
/// of which only the prefix is read).
async fn url_prefix(url: &str, limit: u64) -> Result<(Vec<u8>, u64), String> {
    let (scope, cache) = worker_cache().await?;
    let length = |r: &Response| header(r, "content-length").and_then(|l| l.parse::<u64>().ok());
    if let Some(response) = cached(cache.as_ref(), url).await {
        if let Some(len) = length(&response) {
            return Ok((body_prefix(&response, limit, url).await?, len));
        }
    }
    let headers = Headers::new().map_err(|e| js_error(url, e))?;
    headers
        .set("Range", &format!("bytes=0-{}", limit - 1))
        .map_err(|e| js_error(url, e))?;
    let init = RequestInit::new();
    init.set_headers(&headers);
    let response: Response = JsFuture::from(scope.fetch_with_str_and_init(url, &init))
        .await
        .map_err(|e| js_error(&format!("fetching {url}"), e))?
        .unchecked_into();
    let len = match response.status() {
        // "bytes 0-1023/4096"
        206 => header(&response, "content-range")
            .and_then(|r| r.rsplit('/').next()?.parse().ok())
            .ok_or_else(|| format!("{url}: the server's range response gives no readable Content-Range length"))?,
        200 => length(&response).ok_or_else(|| format!("{url}: the server gives no Content-Length"))?,
        404 => return Err(format!("{url}: not found (HTTP 404)")),
        s => return Err(format!("fetching {url}: HTTP {s}")),
    };
    Ok((body_prefix(&response, limit, url).await?, len))
}

/// Whether a URL names a `.gguf` file (its path, before any query).
pub fn is_gguf(url: &str) -> bool {
    url.split(['?', '#'])
        .next()
        .is_some_and(|path| path.to_ascii_lowercase().ends_with(".gguf"))
}

impl Source {
    /// A checkpoint folder's URL, or a GGUF text model's with its projector's when given.
    pub fn from_urls(model: String, mmproj: Option<String>) -> Self {
        if mmproj.is_some() || is_gguf(&model) {
            Source::GgufUrls { model, mmproj }
        } else {
            Source::Url(model)
        }
    }

    fn url(base: &str, name: &str) -> String {
        format!("{}/{name}", base.trim_end_matches('/'))
    }

    /// Where a file is fetched from: a folder's files by name, a GGUF pair's by their URLs.
    fn url_of(&self, name: &str) -> Option<String> {
        match self {
            Source::Url(base) => Some(Self::url(base, name)),
            Source::GgufUrls { .. } => Some(name.to_string()),
            Source::Files(_) => None,
        }
    }

    fn file(&self, name: &str) -> Option<File> {
        match self {
            Source::Files(files) => files.iter().find(|f| f.name() == name).cloned(),
            Source::Url(_) | Source::GgufUrls { .. } => None,
        }
    }

    /// The first `limit` bytes of a file and its length.
    async fn prefix(&self, name: &str, limit: u64) -> Result<(Vec<u8>, u64), String> {
        if let Some(url) = self.url_of(name) {
            return url_prefix(&url, limit).await;
        }
        let file = self.file(name).ok_or_else(|| format!("{name} was not picked"))?;
        let len = file.size() as u64;
        let blob: &Blob = file.as_ref();
        let part = blob
            .slice_with_f64_and_f64(0.0, limit.min(len) as f64)
            .map_err(|e| js_error(name, e))?;
        let buffer = JsFuture::from(part.array_buffer())
            .await
            .map_err(|e| js_error(name, e))?;
        Ok((Uint8Array::new(&buffer).to_vec(), len))
    }

    /// A GGUF file's header, read from a prefix that grows until it holds it.
    async fn gguf_header(&self, name: &str) -> Result<GgufFile, String> {
        let mut limit = HEADER_FIRST;
        loop {
            let (bytes, len) = self.prefix(name, limit).await?;
            if let Some(header) = Gguf::parse_prefix(&bytes, len).map_err(|e| format!("{name}: {e}"))? {
                return Ok(GgufFile {
                    name: name.to_string(),
                    len,
                    header,
                });
            }
            if (bytes.len() as u64) < limit.min(len) {
                return Err(format!(
                    "{name}: {} bytes came of the first {} asked for",
                    bytes.len(),
                    limit.min(len)
                ));
            }
            if limit >= HEADER_MAX {
                return Err(format!(
                    "{name}: the header does not end within its first {HEADER_MAX} bytes"
                ));
            }
            limit = (limit * 4).min(HEADER_MAX);
        }
    }

    /// The GGUF pair's names, when the source is one: its URLs, or the picked `.gguf` files.
    fn gguf_names(&self) -> Result<Option<(String, Option<String>)>, String> {
        match self {
            Source::Url(_) => Ok(None),
            Source::GgufUrls { model, mmproj } => Ok(Some((model.clone(), mmproj.clone()))),
            Source::Files(files) => {
                let names: Vec<String> = files.iter().map(File::name).collect();
                checkpoint_files::gguf_pair(&names)
            }
        }
    }

    /// Reads a GGUF pair's headers: the config, tokenizer, template and image settings come
    /// from their metadata.
    async fn gguf_info(&self, text: &str, mmproj: Option<&str>) -> Result<CheckpointInfo, String> {
        let text = self.gguf_header(text).await?;
        let mmproj = match mmproj {
            Some(name) => Some(self.gguf_header(name).await?),
            None => None,
        };
        let files = gguf_model(&text, mmproj.as_ref())?
            .small_files()
            .map_err(|e| pair_error(&text, mmproj.as_ref(), e))?;
        let chat_template = files
            .chat_template
            .ok_or_else(|| format!("{} has no chat template (tokenizer.chat_template)", text.name))?;
        Ok(CheckpointInfo {
            config: files.config,
            tokenizer_json: files.tokenizer_json.into_bytes(),
            chat_template,
            preprocessor_json: files.preprocessor_json,
            eos: files.eos_token_ids,
            weights: Weights::Gguf { text, mmproj },
        })
    }

    /// A whole small file; None when the checkpoint has no such file.
    pub async fn bytes(&self, name: &str) -> Result<Option<Vec<u8>>, String> {
        let buffer = match self.url_of(name) {
            Some(url) => {
                let Some(fetched) = fetch_cached(&url).await? else {
                    return Ok(None);
                };
                let mut out = Vec::new();
                fetched
                    .read(name, |chunk| {
                        out.extend_from_slice(chunk);
                        Ok(())
                    })
                    .await?;
                return Ok(Some(out));
            }
            None => match self.file(name) {
                Some(f) => f.array_buffer(),
                None => return Ok(None),
            },
        };
        let buffer = JsFuture::from(buffer).await.map_err(|e| js_error(name, e))?;
        Ok(Some(Uint8Array::new(&buffer).to_vec()))
    }

    /// A whole small text file; None when the checkpoint has no such file.
    pub async fn text(&self, name: &str) -> Result<Option<String>, String> {
        match self.bytes(name).await? {
            Some(b) => String::from_utf8(b)
                .map(Some)
                .map_err(|_| format!("{name} is not UTF-8")),
            None => Ok(None),
        }
    }

    /// The size of a picked file (a URL's is known once its response starts).
    fn size(&self, name: &str) -> Option<u64> {
        self.file(name).map(|f| f.size() as u64)
    }

    /// Reads the small files (a GGUF pair's headers) and names the weight files.
    pub async fn info(&self) -> Result<CheckpointInfo, String> {
        if let Some((text, mmproj)) = self.gguf_names()? {
            return self.gguf_info(&text, mmproj.as_deref()).await;
        }
        let config_text = self
            .text("config.json")
            .await?
            .ok_or("the checkpoint has no config.json")?;
        let config = ModelConfig::from_json(&config_text).map_err(|e| format!("config.json: {e}"))?;
        let tokenizer_json = self
            .bytes("tokenizer.json")
            .await?
            .ok_or("the checkpoint has no tokenizer.json")?;
        let jinja = self.text("chat_template.jinja").await?;
        let json = match jinja {
            Some(_) => None,
            None => self.text("chat_template.json").await?,
        };
        let tokenizer_config = match (&jinja, &json) {
            (None, None) => self.text("tokenizer_config.json").await?,
            _ => None,
        };
        let chat_template = select_chat_template(jinja.as_deref(), json.as_deref(), tokenizer_config.as_deref())
            .map_err(|e| e.to_string())?
            .ok_or("the checkpoint has no chat template (chat_template.jinja, chat_template.json or tokenizer_config.json)")?;
        let generation = self.text("generation_config.json").await?;
        let eos = checkpoint_files::eos_token_ids(&config, generation.as_deref())
            .map_err(|e| format!("generation_config.json: {e}"))?;
        let names = match self.text("model.safetensors.index.json").await? {
            Some(index) => {
                checkpoint_files::shard_names(&index).map_err(|e| format!("model.safetensors.index.json: {e}"))?
            }
            None => vec!["model.safetensors".to_string()],
        };
        let shards = names
            .into_iter()
            .map(|name| {
                let size = self.size(&name);
                (name, size)
            })
            .collect();
        Ok(CheckpointInfo {
            config,
            tokenizer_json,
            chat_template,
            preprocessor_json: self.text("preprocessor_config.json").await?,
            eos,
            weights: Weights::Safetensors(shards),
        })
    }

    /// Hands the file `name` to `each` chunk by chunk, in order, after telling `length` its size
    /// when the source knows it.
    pub async fn stream(
        &self,
        name: &str,
        length: impl FnOnce(Option<u64>),
        mut each: impl FnMut(&[u8]) -> Result<(), String>,
    ) -> Result<(), String> {
        match self.url_of(name) {
            None => {
                let file = self.file(name).ok_or_else(|| format!("{name} was not picked"))?;
                let blob: &Blob = file.as_ref();
                let size = file.size();
                length(Some(size as u64));
                let mut at = 0.0;
                while at < size {
                    let end = (at + FILE_CHUNK).min(size);
                    let part = blob.slice_with_f64_and_f64(at, end).map_err(|e| js_error(name, e))?;
                    let buffer = JsFuture::from(part.array_buffer())
                        .await
                        .map_err(|e| js_error(name, e))?;
                    each(&Uint8Array::new(&buffer).to_vec())?;
                    at = end;
                }
                Ok(())
            }
            Some(url) => {
                let fetched = fetch_cached(&url).await?.ok_or_else(|| format!("{name} is missing"))?;
                length(header(&fetched.response, "content-length").and_then(|l| l.parse().ok()));
                fetched.read(name, each).await
            }
        }
    }
}
