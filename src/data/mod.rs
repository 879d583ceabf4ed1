//! Training data: the bundled corpus and tokenizers (`corpus.rs`), token ids
//! in memory or memory-mapped (`tokens.rs`), text and JSONL documents
//! streamed (`documents.rs`), `upipe tokenize`'s parallel batches
//! (`tokenize.rs`), and the deterministic sampler of training windows.

pub mod corpus;
pub mod documents;
pub mod tokenize;
pub mod tokens;

pub use corpus::{
    Batch, ByteTokenizer, CORPUS, SamplerState, SequenceSampler, Tokenizer, Window, check_vocab,
    load_tokens, write_u32_tokens,
};
pub use tokens::{TokenFormat, Tokens};
