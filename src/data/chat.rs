//! Conversations rendered with a model's own chat template (its
//! `chat_template.jinja`, else the Jinja `chat_template` of its
//! `tokenizer_config.json`) as Hugging Face's
//! `apply_chat_template` renders them, and the mask of the assistant's
//! tokens, the only ones whose loss counts.
//!
//! HF's rules: `trim_blocks` and `lstrip_blocks` on, the context holds
//! `messages`, `add_generation_prompt` (false: a training example is a
//! finished conversation) and the special tokens of the config
//! (`bos_token`, `eos_token`, `unk_token`, `pad_token`); `raise_exception`
//! fails the rendering with the template's message. The rendered text is
//! tokenized without special tokens added (the template writes them).
//!
//! The assistant's part: where the template marks it with `{% generation
//! %}` ... `{% endgeneration %}` blocks, their output; otherwise, for each
//! assistant message `i`, the text between the rendering of messages
//! `..i` with the generation prompt and the rendering of messages `..=i`
//! (its answer and its end-of-turn marker), which must both be prefixes of
//! the whole conversation's rendering. A token is the assistant's when its
//! text overlaps such a part.

use super::corpus::Tokenizer;
use super::limits;
use crate::error::{Error, Result};
use serde_json::Value;
use std::ops::Range;
use std::path::{Path, PathBuf};

/// Marks where a `{% generation %}` block starts / ends in the output.
const GEN_START: char = '\u{E000}';
const GEN_END: char = '\u{E001}';

/// A model's chat template and the special tokens it is rendered with.
pub struct ChatTemplate {
    /// The template, its generation tags replaced by markers.
    source: String,
    has_generation: bool,
    /// `bos_token`, `eos_token`, ... of the config.
    specials: serde_json::Map<String, Value>,
    /// The file it came from (for messages).
    path: PathBuf,
    /// The most bytes a rendering may write.
    max_output: usize,
}

impl ChatTemplate {
    /// The template beside `tokenizer` (a `tokenizer.json` or its
    /// directory): `chat_template.jinja` (the file recent Hugging Face
    /// checkpoints ship, which `transformers` reads before the config's),
    /// else the `chat_template` of `tokenizer_config.json`; the special
    /// tokens from `tokenizer_config.json`. `None` when there is neither. A
    /// template that does not parse is an error naming its file.
    pub fn find(tokenizer: &Path) -> Result<Option<ChatTemplate>> {
        let dir = match tokenizer.is_dir() {
            true => tokenizer.to_path_buf(),
            false => tokenizer
                .parent()
                .map(Path::to_path_buf)
                .unwrap_or_default(),
        };
        let path = dir.join("tokenizer_config.json");
        let config: Value = match path.is_file() {
            true => {
                let text = std::fs::read_to_string(&path)
                    .map_err(|e| Error::io(format!("reading {}", path.display()), e))?;
                serde_json::from_str(&text).map_err(|e| {
                    Error::Config(format!("{} is not valid JSON: {e}", path.display()))
                })?
            }
            false => Value::Null,
        };
        let specials = special_tokens(&config);
        let jinja = dir.join("chat_template.jinja");
        if jinja.is_file() {
            let source = std::fs::read_to_string(&jinja)
                .map_err(|e| Error::io(format!("reading {}", jinja.display()), e))?;
            if config_template(&config).is_some_and(|s| s != source) {
                tracing::info!(
                    "{} and the chat_template of {} differ: using {0} (as transformers does)",
                    jinja.display(),
                    path.display()
                );
            }
            return ChatTemplate::new(&source, specials, jinja).map(Some);
        }
        match config_template(&config) {
            Some(source) => ChatTemplate::new(&source, specials, path).map(Some),
            None => Ok(None),
        }
    }

    /// The template in the Jinja file `path`, with the special tokens of
    /// the `tokenizer_config.json` beside `tokenizer` (a `tokenizer.json`
    /// or its directory; none: no special tokens).
    pub fn from_file(path: &Path, tokenizer: Option<&Path>) -> Result<ChatTemplate> {
        let source = std::fs::read_to_string(path)
            .map_err(|e| Error::io(format!("reading the chat template {}", path.display()), e))?;
        let dir = tokenizer.map(|t| match t.is_dir() {
            true => t.to_path_buf(),
            false => t.parent().map(Path::to_path_buf).unwrap_or_default(),
        });
        let config = dir.map(|d| d.join("tokenizer_config.json"));
        let config: Value = match config.filter(|c| c.is_file()) {
            Some(c) => {
                let text = std::fs::read_to_string(&c)
                    .map_err(|e| Error::io(format!("reading {}", c.display()), e))?;
                serde_json::from_str(&text)
                    .map_err(|e| Error::Config(format!("{} is not valid JSON: {e}", c.display())))?
            }
            None => Value::Null,
        };
        ChatTemplate::new(&source, special_tokens(&config), path.to_path_buf())
    }

    /// The file the template came from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The error for chat data where `tokenizer` has no chat template.
    pub fn missing(tokenizer: &str) -> Error {
        Error::Config(format!(
            "chat data (JSONL lines with \"messages\" or \"conversations\") is rendered with \
             the model's chat template, but --tokenizer {tokenizer} has neither a \
             chat_template.jinja nor a tokenizer_config.json with a chat_template beside it; \
             tokenize with the model's own tokenizer directory"
        ))
    }

    /// A template from its Jinja `source` and special tokens.
    pub fn new(
        source: &str,
        specials: serde_json::Map<String, Value>,
        path: PathBuf,
    ) -> Result<ChatTemplate> {
        let (source, has_generation) = mark_generation(source);
        let t = ChatTemplate {
            source,
            has_generation,
            specials,
            path,
            max_output: limits::Limits::default().max_doc_bytes,
        };
        // a syntax error is the template's, whatever the data
        t.env()
            .template_from_str(&t.source)
            .map_err(|e| t.error(e, "parse"))?;
        Ok(t)
    }

    /// The template writing at most `bytes` per rendering (`--max-doc-mb`).
    pub fn with_max_output(mut self, bytes: usize) -> ChatTemplate {
        self.max_output = bytes;
        self
    }

    fn env(&self) -> minijinja::Environment<'_> {
        let mut env = minijinja::Environment::new();
        let syntax = minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .expect("the default delimiters");
        env.set_syntax(syntax);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |msg: String| -> std::result::Result<String, minijinja::Error> {
                Err(minijinja::Error::new(
                    minijinja::ErrorKind::InvalidOperation,
                    msg,
                ))
            },
        );
        env
    }

    fn error(&self, e: minijinja::Error, what: &str) -> Error {
        let mut msg = e.to_string();
        if let Some(detail) = e.detail() {
            msg = format!("{msg}: {detail}");
        }
        Error::Config(format!(
            "the chat template of {} failed to {what}: {msg}",
            self.path.display()
        ))
    }

    /// The error of a rendering that failed: out of `fuel`, `over` the
    /// output limit, or the template's own.
    fn render_error(&self, e: minijinja::Error, fuel: u64, over: bool) -> Error {
        if over {
            return Error::Config(format!(
                "the chat template of {} rendered a conversation longer than {} (the longest \
                 document upipe writes): raise it with --max-doc-mb N if the conversation is \
                 that long, else fix the template",
                self.path.display(),
                limits::mib_text(self.max_output)
            ));
        }
        if e.kind() == minijinja::ErrorKind::OutOfFuel {
            return Error::Config(format!(
                "the chat template of {} ran out of fuel rendering a conversation: it took more \
                 than {fuel} steps ({} plus {} per byte of the conversation), as a template \
                 stuck in a loop does; fix the template",
                self.path.display(),
                limits::CHAT_FUEL_BASE,
                limits::CHAT_FUEL_PER_BYTE
            ));
        }
        self.error(e, "render a conversation")
    }

    /// The text of `messages`, and the spans of its `{% generation %}`
    /// blocks (byte ranges of the text).
    pub fn render(
        &self,
        messages: &[Value],
        generation_prompt: bool,
    ) -> Result<(String, Vec<Range<usize>>)> {
        let env = self.env();
        let mut ctx = self.specials.clone();
        ctx.insert("messages".into(), Value::Array(messages.to_vec()));
        ctx.insert(
            "add_generation_prompt".into(),
            Value::Bool(generation_prompt),
        );
        let fuel = limits::chat_fuel(serde_json::to_string(messages).map_or(0, |j| j.len()));
        let mut env = env;
        env.set_fuel(Some(fuel));
        let tmpl = env
            .template_from_str(&self.source)
            .map_err(|e| self.error(e, "parse"))?;
        let mut out = Bounded {
            text: Vec::new(),
            max: self.max_output,
            over: false,
        };
        let ctx = minijinja::Value::from(minijinja::value::Serde(&ctx));
        if let Err(e) = tmpl.render_captured_to(ctx, &mut out) {
            return Err(self.render_error(e, fuel, out.over));
        }
        let out = String::from_utf8(out.text).map_err(|_| {
            Error::Config(format!(
                "the chat template of {} rendered text that is not UTF-8",
                self.path.display()
            ))
        })?;
        Ok(take_markers(&out))
    }

    /// The text of a conversation and the byte ranges of the assistant's parts.
    pub fn assistant_spans(&self, messages: &[Value]) -> Result<(String, Vec<Range<usize>>)> {
        check_roles(messages, &self.path)?;
        let (text, spans) = self.render(messages, false)?;
        if self.has_generation {
            return Ok((text, spans));
        }
        let mut spans = Vec::new();
        for (i, m) in messages.iter().enumerate() {
            if m.get("role").and_then(Value::as_str) != Some("assistant") {
                continue;
            }
            let (before, _) = self.render(&messages[..i], true)?;
            let (upto, _) = self.render(&messages[..=i], false)?;
            if !upto.starts_with(&before) || !text.starts_with(&upto) {
                return crate::config_err!(
                    "the chat template of {} does not render a conversation turn by turn (the \
                     text up to assistant message {i} is not a prefix of the whole), so the \
                     assistant's tokens cannot be found: mark them in the template with \
                     {{% generation %}} ... {{% endgeneration %}} blocks",
                    self.path.display()
                );
            }
            spans.push(before.len()..upto.len());
        }
        Ok((text, spans))
    }
}

/// The `chat_template` of a `tokenizer_config.json` (of a list of named
/// templates, the default one); `None` when it has none.
fn config_template(config: &Value) -> Option<String> {
    let source = match config.get("chat_template") {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(list)) => list
            .iter()
            .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
            .and_then(|t| t.get("template")?.as_str().map(str::to_string))
            .unwrap_or_default(),
        _ => String::new(),
    };
    (!source.is_empty()).then_some(source)
}

/// `bos_token`, `eos_token`, `unk_token`, `pad_token` of a
/// `tokenizer_config.json` (a string, or an object with its `content`).
fn special_tokens(config: &Value) -> serde_json::Map<String, Value> {
    let mut specials = serde_json::Map::new();
    for key in ["bos_token", "eos_token", "unk_token", "pad_token"] {
        let v = config.get(key);
        let v = v.and_then(|v| v.get("content")).or(v);
        if let Some(Value::String(s)) = v {
            specials.insert(key.into(), Value::String(s.clone()));
        }
    }
    specials
}

/// The roles a conversation may hold; another is refused (a template
/// would render it as it pleases, or drop it).
const ROLES: [&str; 5] = ["system", "user", "assistant", "tool", "developer"];

fn check_roles(messages: &[Value], path: &Path) -> Result<()> {
    for (i, m) in messages.iter().enumerate() {
        let role = m.get("role").and_then(Value::as_str).unwrap_or("");
        if !ROLES.contains(&role) {
            return crate::config_err!(
                "message {i} has role \"{role}\", which the chat template of {} is not known to \
                 render; use one of {}",
                path.display(),
                ROLES.join(", ")
            );
        }
    }
    Ok(())
}

/// A rendering's output, refused past `max` bytes (`over` says so).
struct Bounded {
    text: Vec<u8>,
    max: usize,
    over: bool,
}

impl std::io::Write for Bounded {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if self.text.len().saturating_add(buf.len()) > self.max {
            self.over = true;
            return Err(std::io::Error::other("the output limit"));
        }
        self.text.extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Replaces `{% generation %}` / `{% endgeneration %}` (with any
/// whitespace control) by expressions printing the markers.
fn mark_generation(source: &str) -> (String, bool) {
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    let mut found = false;
    while let Some(at) = rest.find("{%") {
        out.push_str(&rest[..at]);
        let tag = &rest[at..];
        let Some(close) = tag.find("%}") else {
            out.push_str(tag);
            return (out, found);
        };
        let inner = &tag[2..close];
        let (lead, body) = match inner.strip_prefix('-') {
            Some(b) => ("-", b),
            None => ("", inner),
        };
        let (body, trail) = match body.strip_suffix('-') {
            Some(b) => (b, "-"),
            None => (body, ""),
        };
        let marker = match body.trim() {
            "generation" => Some(GEN_START),
            "endgeneration" => Some(GEN_END),
            _ => None,
        };
        match marker {
            Some(c) => {
                found = true;
                out.push_str(&format!("{{{{{lead} \"{c}\" {trail}}}}}"));
            }
            None => out.push_str(&tag[..close + 2]),
        }
        rest = &tag[close + 2..];
    }
    out.push_str(rest);
    (out, found)
}

/// The text without markers, and the spans between them.
fn take_markers(marked: &str) -> (String, Vec<Range<usize>>) {
    let mut text = String::with_capacity(marked.len());
    let mut spans = Vec::new();
    let mut open = None;
    for c in marked.chars() {
        match c {
            GEN_START => open = Some(text.len()),
            GEN_END => spans.extend(open.take().map(|s| s..text.len())),
            c => text.push(c),
        }
    }
    (text, spans)
}

/// The ids of a conversation rendered by `template` and tokenized by
/// `tok` (no special tokens added), and which of them are the assistant's.
pub fn encode_chat(
    tok: &Tokenizer,
    template: &ChatTemplate,
    messages: &[Value],
) -> Result<(Vec<u32>, Vec<bool>)> {
    let (text, spans) = template.assistant_spans(messages)?;
    let Tokenizer::Hf(t) = tok else {
        return crate::config_err!(
            "chat data needs the model's HF tokenizer (its tokenizer.json and chat template), \
             not the byte tokenizer"
        );
    };
    let enc = t
        .encode(text.as_str(), false)
        .map_err(|e| Error::Config(format!("tokenizing a rendered conversation failed: {e}")))?;
    let mask = enc
        .get_offsets()
        .iter()
        .map(|&(s, e)| spans.iter().any(|r| s < r.end && e > r.start))
        .collect();
    Ok((enc.get_ids().to_vec(), mask))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const CHATML: &str = "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + \
        m['content'].strip() + '<|im_end|>\n' }}{% endfor %}\
        {% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

    fn template(src: &str) -> ChatTemplate {
        let mut sp = serde_json::Map::new();
        sp.insert("eos_token".into(), json!("<|im_end|>"));
        ChatTemplate::new(src, sp, PathBuf::from("tokenizer_config.json")).unwrap()
    }

    fn convo() -> Vec<Value> {
        vec![
            json!({"role": "user", "content": " hi "}),
            json!({"role": "assistant", "content": "hello"}),
        ]
    }

    #[test]
    fn turn_by_turn_spans_cover_the_answer_and_its_end_of_turn() {
        let (text, spans) = template(CHATML).assistant_spans(&convo()).unwrap();
        assert_eq!(
            text,
            "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nhello<|im_end|>\n"
        );
        assert_eq!(spans.len(), 1);
        assert_eq!(&text[spans[0].clone()], "hello<|im_end|>\n");
    }

    #[test]
    fn generation_blocks_mark_the_assistant() {
        let src = "{% for m in messages %}{% if m.role == 'assistant' %}A: \
            {%- generation -%} {{ m.content }};{% endgeneration %}{% else %}U: {{ m.content }}\n\
            {% endif %}{% endfor %}";
        let t = template(src);
        let (text, spans) = t.assistant_spans(&convo()).unwrap();
        assert_eq!(text, "U:  hi \nA:hello;");
        assert_eq!(&text[spans[0].clone()], "hello;");
    }

    #[test]
    fn bad_templates_and_roles_are_refused() {
        let t = template("{{ raise_exception('only user and assistant roles') }}");
        let e = t.assistant_spans(&convo()).unwrap_err().to_string();
        assert!(
            e.contains("only user and assistant roles") && e.contains("tokenizer_config.json"),
            "{e}"
        );
        let e = template(CHATML)
            .assistant_spans(&[json!({"role": "narrator", "content": "x"})])
            .unwrap_err()
            .to_string();
        assert!(e.contains("role \"narrator\""), "{e}");
        let e = ChatTemplate::new("{% for %}", Default::default(), PathBuf::from("t.json"))
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("failed to parse"), "{e}");
        // a template that drops earlier turns cannot be cut turn by turn
        let reversed = "{% for m in messages|reverse %}{{ m.content }}|{% endfor %}";
        let e = template(reversed)
            .assistant_spans(&convo())
            .unwrap_err()
            .to_string();
        assert!(e.contains("{% generation %}"), "{e}");
    }

    #[test]
    fn runaway_templates_stop_on_fuel_or_the_output_limit_naming_the_file() {
        let loops =
            "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}";
        let e = template(loops)
            .render(&convo(), false)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("tokenizer_config.json") && e.contains("ran out of fuel"),
            "{e}"
        );
        let big = "{% for i in range(1000) %}{{ 'x' * 100000000 }}{% endfor %}";
        let e = template(big)
            .render(&convo(), false)
            .unwrap_err()
            .to_string();
        assert!(e.contains("tokenizer_config.json"), "{e}");
        let wide = "{% for i in range(1000) %}{{ 'x' * 1000 }}{% endfor %}";
        let e = template(wide)
            .with_max_output(100_000)
            .render(&convo(), false)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("longer than 100000 bytes") && e.contains("--max-doc-mb"),
            "{e}"
        );
        let (text, _) = template(wide)
            .with_max_output(1 << 20)
            .render(&convo(), false)
            .unwrap();
        assert_eq!(text.len(), 1_000_000);
    }
}
