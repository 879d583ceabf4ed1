//! The rendezvous wire format: a fixed hello that each rank sends once, then
//! frames of `tag: u8, length: u64 LE, payload`.

use std::io::{Read, Write};

/// Identifies an upipe rendezvous peer (guards against stray connections).
const MAGIC: [u8; 4] = *b"UPRV";
/// Bumped on any incompatible change of this format.
const VERSION: u16 = 1;
/// Size of the hello on the wire.
pub const HELLO_LEN: usize = 4 + 2 + 4 + 4;
/// Largest payload accepted; anything bigger is a corrupt or foreign stream.
pub const MAX_PAYLOAD: u64 = 1 << 30;

/// What a frame carries. Every rank calls the same collectives in the same
/// order, so the tag doubles as a check that they agree.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Tag {
    /// Rank 0 → peer: every rank arrived, the rendezvous is complete.
    Welcome,
    /// Peer → rank 0: this rank's bytes; rank 0 → peer: everyone's bytes.
    AllGather,
    /// Rank 0 → peer: the broadcast bytes.
    Broadcast,
    /// Peer → rank 0: arrived; rank 0 → peer: everyone arrived.
    Barrier,
    /// Either way: the rendezvous failed; the payload is the reason (UTF-8).
    Abort,
}

impl Tag {
    fn to_byte(self) -> u8 {
        match self {
            Tag::Welcome => 0,
            Tag::AllGather => 1,
            Tag::Broadcast => 2,
            Tag::Barrier => 3,
            Tag::Abort => 0xff,
        }
    }

    fn from_byte(b: u8) -> Option<Tag> {
        Some(match b {
            0 => Tag::Welcome,
            1 => Tag::AllGather,
            2 => Tag::Broadcast,
            3 => Tag::Barrier,
            0xff => Tag::Abort,
            _ => return None,
        })
    }

    /// The collective a tag belongs to, for error messages.
    pub fn operation(self) -> &'static str {
        match self {
            Tag::Welcome => "connect",
            Tag::AllGather => "all_gather_bytes",
            Tag::Broadcast => "broadcast_bytes",
            Tag::Barrier => "barrier",
            Tag::Abort => "abort",
        }
    }
}

/// A rank's announcement of itself.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Hello {
    pub rank: u32,
    pub world_size: u32,
}

/// Why bytes read from a stream are not a valid message.
#[derive(Debug)]
pub enum WireError {
    /// The socket failed or closed.
    Io(std::io::Error),
    /// The peer does not speak this protocol (or another version of it).
    Foreign(String),
}

impl From<std::io::Error> for WireError {
    fn from(e: std::io::Error) -> Self {
        WireError::Io(e)
    }
}

impl std::fmt::Display for WireError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            WireError::Io(e) => write!(f, "{e}"),
            WireError::Foreign(why) => f.write_str(why),
        }
    }
}

/// Sends the hello.
pub fn write_hello(w: &mut impl Write, hello: Hello) -> std::io::Result<()> {
    let mut buf = Vec::with_capacity(HELLO_LEN);
    buf.extend_from_slice(&MAGIC);
    buf.extend_from_slice(&VERSION.to_le_bytes());
    buf.extend_from_slice(&hello.rank.to_le_bytes());
    buf.extend_from_slice(&hello.world_size.to_le_bytes());
    w.write_all(&buf)?;
    w.flush()
}

/// Reads and checks a hello.
pub fn read_hello(r: &mut impl Read) -> Result<Hello, WireError> {
    let mut buf = [0u8; HELLO_LEN];
    r.read_exact(&mut buf)?;
    if buf[..4] != MAGIC {
        return Err(WireError::Foreign(
            "not an upipe rendezvous client".to_string(),
        ));
    }
    let version = u16::from_le_bytes([buf[4], buf[5]]);
    if version != VERSION {
        return Err(WireError::Foreign(format!(
            "rendezvous protocol version {version}, this build speaks {VERSION}; \
             run the same upipe binary on every node"
        )));
    }
    let word = |at: usize| u32::from_le_bytes([buf[at], buf[at + 1], buf[at + 2], buf[at + 3]]);
    Ok(Hello {
        rank: word(6),
        world_size: word(10),
    })
}

/// Sends one frame.
pub fn write_frame(w: &mut impl Write, tag: Tag, payload: &[u8]) -> std::io::Result<()> {
    let mut header = [0u8; 9];
    header[0] = tag.to_byte();
    header[1..].copy_from_slice(&(payload.len() as u64).to_le_bytes());
    w.write_all(&header)?;
    w.write_all(payload)?;
    w.flush()
}

/// Reads one frame.
pub fn read_frame(r: &mut impl Read) -> Result<(Tag, Vec<u8>), WireError> {
    let mut header = [0u8; 9];
    r.read_exact(&mut header)?;
    let tag = Tag::from_byte(header[0])
        .ok_or_else(|| WireError::Foreign(format!("unknown frame tag {}", header[0])))?;
    let mut len = [0u8; 8];
    len.copy_from_slice(&header[1..]);
    let len = u64::from_le_bytes(len);
    if len > MAX_PAYLOAD {
        return Err(WireError::Foreign(format!(
            "frame of {len} bytes exceeds the {MAX_PAYLOAD}-byte limit"
        )));
    }
    let mut payload = vec![0u8; len as usize];
    r.read_exact(&mut payload)?;
    Ok((tag, payload))
}

/// Packs a list of byte strings (one per rank) into one payload.
pub fn encode_list(items: &[Vec<u8>]) -> Vec<u8> {
    let total: usize = items.iter().map(|i| 8 + i.len()).sum();
    let mut out = Vec::with_capacity(8 + total);
    out.extend_from_slice(&(items.len() as u64).to_le_bytes());
    for item in items {
        out.extend_from_slice(&(item.len() as u64).to_le_bytes());
        out.extend_from_slice(item);
    }
    out
}

/// Unpacks [`encode_list`]; `None` if the payload is malformed.
pub fn decode_list(mut payload: &[u8]) -> Option<Vec<Vec<u8>>> {
    let count = take_u64(&mut payload)?;
    let mut items = Vec::new();
    for _ in 0..count {
        let len = usize::try_from(take_u64(&mut payload)?).ok()?;
        if payload.len() < len {
            return None;
        }
        let (item, rest) = payload.split_at(len);
        items.push(item.to_vec());
        payload = rest;
    }
    payload.is_empty().then_some(items)
}

fn take_u64(buf: &mut &[u8]) -> Option<u64> {
    let (head, rest) = buf.split_first_chunk::<8>()?;
    *buf = rest;
    Some(u64::from_le_bytes(*head))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hello_round_trip_and_foreign_bytes() {
        let mut buf = Vec::new();
        let hello = Hello {
            rank: 3,
            world_size: 8,
        };
        write_hello(&mut buf, hello).unwrap();
        assert_eq!(buf.len(), HELLO_LEN);
        assert_eq!(read_hello(&mut buf.as_slice()).unwrap(), hello);
        buf[0] = b'X';
        assert!(matches!(
            read_hello(&mut buf.as_slice()),
            Err(WireError::Foreign(_))
        ));
    }

    #[test]
    fn frame_round_trip_and_limits() {
        let mut buf = Vec::new();
        write_frame(&mut buf, Tag::Broadcast, b"abc").unwrap();
        write_frame(&mut buf, Tag::Barrier, b"").unwrap();
        let mut r = buf.as_slice();
        assert_eq!(
            read_frame(&mut r).unwrap(),
            (Tag::Broadcast, b"abc".to_vec())
        );
        assert_eq!(read_frame(&mut r).unwrap(), (Tag::Barrier, vec![]));
        assert!(matches!(read_frame(&mut r), Err(WireError::Io(_))));
        let mut huge = vec![Tag::AllGather.to_byte()];
        huge.extend_from_slice(&(MAX_PAYLOAD + 1).to_le_bytes());
        assert!(matches!(
            read_frame(&mut huge.as_slice()),
            Err(WireError::Foreign(_))
        ));
        assert!(matches!(
            read_frame(&mut [7u8; 9].as_slice()),
            Err(WireError::Foreign(_))
        ));
    }

    #[test]
    fn list_round_trip_and_corruption() {
        let items = vec![b"x".to_vec(), vec![], vec![1, 2, 3]];
        let packed = encode_list(&items);
        assert_eq!(decode_list(&packed).unwrap(), items);
        assert!(decode_list(&packed[..packed.len() - 1]).is_none());
        let mut extra = packed.clone();
        extra.push(0);
        assert!(decode_list(&extra).is_none());
    }
}
