//! A client that sends its bytes one at a time, slowly: the behaviour under test (a slow head,
//! a slow body), not a wait for something to happen.

use std::time::Duration;

use tokio::{
    io::{AsyncWrite, AsyncWriteExt as _},
    task::JoinHandle,
};

/// Writes `bytes` one at a time, `every` after each, until they are all sent or the
/// connection breaks; abort the task to stop sooner.
pub fn trickle<W>(mut writer: W, bytes: Vec<u8>, every: Duration) -> JoinHandle<()>
where
    W: AsyncWrite + Unpin + Send + 'static,
{
    tokio::spawn(async move {
        for byte in bytes {
            if writer.write_all(&[byte]).await.is_err() {
                return;
            }
            tokio::time::sleep(every).await;
        }
    })
}
